"""Unit tests of marlflow.interventions on toy tensors: the KL estimate, I6, same_role_norm, mass_balance, and
cliff_guard's decision on simulated eval curves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from marlflow import interventions as I
from marlflow.core.config import INTERVENTION_KINDS
from marlflow.core.definitions import ALPHA, TERMINAL_WINDOW


def test_k3_matches_an_independent_kl_computation():
    """k3 per token is exp(r) - r - 1 with r = ref - logp, and averaged over tokens sampled from pi it
    estimates KL(pi || ref) = sum_x pi(x) log(pi(x)/ref(x)) (computed exactly here)."""
    logp = torch.tensor([[-0.1, -2.0, -0.7], [-1.5, -0.3, -0.2]])
    ref = torch.tensor([[-0.4, -1.0, -0.7], [-0.5, -0.9, -3.0]])
    by_hand = [
        [math.exp(b - a) - (b - a) - 1 for a, b in zip(ra, rb)] for ra, rb in zip(logp.tolist(), ref.tolist())
    ]
    assert torch.allclose(I.k3_kl(logp, ref), torch.tensor(by_hand), atol=1e-6)
    assert (I.k3_kl(logp, ref) >= 0).all() and I.k3_kl(logp, logp).abs().max() == 0
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    expect = (sum(by_hand[0][:2]) / 2 + sum(by_hand[1]) / 3) / 2
    assert I.masked_mean_kl(logp, ref, mask) == pytest.approx(expect, rel=1e-6)

    g = torch.Generator().manual_seed(0)
    pi = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    exact = float((pi * (pi / q).log()).sum())
    x = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    est = float(I.k3_kl(pi.log()[x], q.log()[x]).mean())
    assert est == pytest.approx(exact, rel=0.02)


def test_role_beta_adds_the_per_role_anchor_only_to_its_role():
    spec = {"kind": "kl_anchor", "beta": {"aggregator": 0.05}}
    assert I.role_beta(spec, "aggregator", 0.0) == pytest.approx(0.05)
    assert I.role_beta(spec, "generator", 0.0) == 0.0
    assert I.role_beta(spec, "aggregator", 0.01) == pytest.approx(0.06)
    assert I.role_beta({"kind": "none"}, "aggregator", 0.02) == 0.02


def test_coherence_scales_by_one_minus_lambda_at_cos_one_and_leaves_cos_le_zero():
    g = torch.tensor([1.0, 2.0, -1.0])
    assert I.coherence_scale(g, 3 * g, 0.3) == pytest.approx(0.7)
    assert I.coherence_scale(g, -g, 0.3) == 1.0  # cos = -1
    assert I.coherence_scale(g, torch.tensor([2.0, -1.0, 0.0]), 0.3) == 1.0  # cos = 0
    assert I.coherence_scale(g, None, 0.3) == 1.0  # no history yet
    half = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])  # cos = 1/sqrt(2)
    assert I.coherence_scale(*half, 0.2) == pytest.approx(1 - 0.2 / math.sqrt(2))


def test_coherence_hook_uses_the_ema_and_commit_updates_it():
    spec = {"kind": "coherence", "lam": 0.3, "window": 4}
    st = I.State()
    g = {"generator": torch.tensor([1.0, 0.0]), "aggregator": torch.tensor([0.0, 2.0])}
    own = {"generator": 0.5, "aggregator": 0.5}
    assert I.role_scales(spec, st, "voting", g, own, {}) == {"generator": 1.0, "aggregator": 1.0}
    I.commit(spec, st, g, own)
    assert torch.equal(st.ema["generator"], torch.tensor([2.0, 0.0]))  # g / f starts the EMA
    s = I.role_scales(spec, st, "voting", g, own, {})
    assert s["generator"] == pytest.approx(0.7) and s["aggregator"] == pytest.approx(0.7)
    I.commit(spec, st, {"generator": torch.tensor([0.0, 1.0])}, {"generator": 0.5})
    assert torch.allclose(
        st.ema["generator"],
        torch.tensor([2.0, 0.0]) + (torch.tensor([0.0, 2.0]) - torch.tensor([2.0, 0.0])) / 4,
    )
    restored = I.State()
    restored.load_state_dict(st.state_dict())
    assert torch.equal(restored.ema["generator"], st.ema["generator"])


def test_same_role_norm_makes_three_identical_voters_weigh_as_one():
    v = torch.tensor([0.3, -1.2, 0.5])
    slots = ["generator0", "generator1", "generator2"]
    g_role = v + v + v  # the role's gradient is the sum of its slots' gradients
    s = I.role_scales({"kind": "same_role_norm"}, I.State(), "voting", {"generator": g_role, "aggregator": v},
                      {"generator": 1.0, "aggregator": 1.0}, {"generator": slots, "aggregator": ["aggregator0"]})  # fmt: skip
    assert torch.allclose(s["generator"] * g_role, v)
    assert s["aggregator"] == 1.0
    assert I.same_role_scale("orch_workers", "worker", ["worker0", "worker1"]) == 0.5
    assert I.same_role_scale("orch_workers", "orchestrator", ["orchestrator0"]) == 1.0
    assert (
        I.same_role_scale("eval_opt", "generator", ["generator0", "generator1"]) == 1.0
    )  # sequential rounds


@pytest.mark.parametrize("cap", [0.5, 0.6, 0.8])
def test_mass_balance_caps_shares(cap):
    torch.manual_seed(0)
    big = torch.randn(50) * 10
    grads = [big, torch.randn(50) + 0.1 * big, torch.randn(50)]
    G = I.gram(grads)
    before = I.scaled_shares(G, torch.ones(3))
    assert before.max() > cap  # the dominant role is over the cap to begin with
    a = I.mass_balance_scales(G, cap)
    after = I.scaled_shares(G, a)
    assert after.max() <= cap + 1e-5 and after.sum() == pytest.approx(1.0)
    assert ((a > 0) & (a <= 1)).all()
    # independent check on the flat vectors: <a_r g_r, g> / ||g||^2
    total = sum(x * g for x, g in zip(a.float(), grads))
    direct = [float(x * torch.dot(g, total) / torch.dot(total, total)) for x, g in zip(a.float(), grads)]
    assert max(direct) <= cap + 1e-4


def test_mass_balance_leaves_balanced_roles_alone():
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]
    a = I.mass_balance_scales(I.gram(grads), 0.6)
    assert torch.equal(a, torch.ones(2, dtype=torch.float64))
    spec = {"kind": "mass_balance", "cap": 0.6}
    s = I.role_scales(spec, I.State(), "voting", {"generator": grads[0], "aggregator": grads[1]}, {}, {})
    assert s == {"generator": 1.0, "aggregator": 1.0}


# ---------------------------------------------------------------- cliff_guard

GUARD = {"kind": "cliff_guard", "max_restores": 2, "lr_factor": 0.5, "window": 3, "alpha": 0.04}


def _curve(accs, n=200):
    return [(10 * k, a, n) for k, a in enumerate(accs)]


def _online(accs, n, spec=GUARD, looks=None):
    """The trainer's use of the guard on one curve, without weights: the steps at which it restores."""
    st, fired = I.State(), []
    for step, acc, m in _curve(accs, n):
        if I.guard_observe(st, step, acc, m):
            st.best = {"step": step, "acc": acc, "n": m}
            continue
        if I.guard_check(st.evals, st.restores, spec, looks or len(accs) - 1)["fire"]:
            fired.append(step)
            st.restores += 1
            st.evals = [(st.best["step"], st.best["acc"], st.best["n"])]
    return fired


def test_guard_defaults_are_the_analysis_constants():
    params = INTERVENTION_KINDS["cliff_guard"]
    assert params["window"][2] == TERMINAL_WINDOW and params["alpha"][2] == ALPHA


def test_guard_fires_on_a_clear_late_drop_and_respects_max_restores():
    evals = _curve([0.5, 0.6, 0.62, 0.61, 0.6, 0.62, 0.4, 0.38])
    r = I.guard_check(evals, 0, GUARD, looks=12)
    assert r["cliff"] and r["fire"] and r["drop"] > r["drop_z"] * r["drop_se"]
    assert r["drop_z"] > I.guard_check(evals, 0, GUARD, looks=1)["drop_z"]  # alpha is split over the looks
    r = I.guard_check(evals, 2, GUARD, looks=12)
    assert r["cliff"] and not r["fire"]  # still detected (and logged), but no restore left
    assert I.guard_check(evals, 2, {**GUARD, "max_restores": 3}, looks=12)["fire"]
    # the same drop without the last two evals, or a last eval as good as the best, is no cliff
    assert not I.guard_check(evals[:6], 0, GUARD, looks=12)["cliff"]
    assert not I.guard_check(_curve([0.9, 0.1, 0.1, 0.9]), 0, GUARD, looks=3)["cliff"]
    assert not I.guard_check(evals[:1], 0, GUARD, looks=12)["cliff"]


def test_guard_restores_a_run_that_drops_twice_at_most_max_restores_times():
    accs = [0.3, 0.6, 0.6, 0.3, 0.6, 0.6, 0.3, 0.3, 0.3, 0.3]  # back at 0.6 after the restore at step 30
    assert _online(accs, 200) == [30, 60]  # after a restore the curve is the best eval and what follows
    assert _online(accs, 200, {**GUARD, "max_restores": 1}) == [30]
    assert _online(accs, 200, {**GUARD, "max_restores": 3}) == [30, 60, 70]


@pytest.mark.parametrize("p", [0.3, 0.8])
def test_guard_rarely_restores_a_flat_run(p):
    """Flat accuracy, 12 evals after the base at n=200, the guard tested after each: the union bound over the
    12 looks keeps the chance of any restore in a run at or below alpha (0.04; about 0.02 simulated)."""
    rng = np.random.default_rng(0)
    runs = rng.binomial(200, p, size=(300, 13)) / 200
    rate = np.mean([bool(_online(list(accs), 200)) for accs in runs])
    assert rate <= GUARD["alpha"]


def test_guard_observe_keeps_the_first_of_equal_bests():
    st = I.State()
    assert I.guard_observe(st, 0, 0.5, 10)
    st.best = {"step": 0, "acc": 0.5, "n": 10}
    assert not I.guard_observe(st, 1, 0.5, 10) and not I.guard_observe(st, 2, 0.4, 10)
    assert I.guard_observe(st, 3, 0.6, 10)
    assert st.evals == [(0, 0.5, 10), (1, 0.5, 10), (2, 0.4, 10), (3, 0.6, 10)]
    assert I.eval_looks(120, 10) == 12 and I.eval_looks(4, 3) == 2 and I.eval_looks(1, 1) == 1


def test_guard_state_round_trips_and_its_copy_does_not_alias():
    w = torch.ones(3)
    st = I.State(evals=[(0, 0.5, 10)], restores=1, lr_scale=0.5)
    st.best = {
        "step": 0,
        "acc": 0.5,
        "n": 10,
        "adapters": {"p": {"w": w}},
        "optimizers": {"p": {"state": {}}},
    }
    sd = st.state_dict()
    w += 1  # a later step changes the live tensor; the checkpointed copy must not change with it
    back = I.State()
    back.load_state_dict(sd)
    assert back.evals == st.evals and back.restores == 1 and back.lr_scale == 0.5
    assert torch.equal(back.best["adapters"]["p"]["w"], torch.ones(3))
    old = I.State()
    old.load_state_dict({"ema": {}})  # a checkpoint from before cliff_guard
    assert old.best is None and old.evals == [] and old.restores == 0 and old.lr_scale == 1.0


def test_bias_corrected_k3_gradient_is_the_reverse_kl_gradient():
    """What TRL's use_bias_correction_kl (set to True in marlflow.training.trainer._grpo_args) does to the KL term's
    gradient, exactly (expectation over every token of a categorical policy, no sampling): k3 times the
    on-policy importance ratio exp(logp - logp.detach()) differentiates to the reverse KL(pi || ref), the KL
    that grpo.beta and kl_anchor name; plain k3 differentiates to the forward KL(ref || pi)."""
    torch.manual_seed(0)
    theta = torch.randn(11, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(11, dtype=torch.float64).log_softmax(0)

    def expected_grad(corrected: bool) -> torch.Tensor:
        logp = theta.log_softmax(0)
        term = I.k3_kl(logp, ref) * (torch.exp(logp - logp.detach()) if corrected else 1.0)
        (grad,) = torch.autograd.grad((logp.exp().detach() * term).sum(), theta)  # E over y ~ pi
        return grad

    logp = theta.log_softmax(0)
    (reverse,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    logp = theta.log_softmax(0)
    (forward,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)
    assert torch.allclose(expected_grad(True), reverse, atol=1e-12)
    assert torch.allclose(expected_grad(False), forward, atol=1e-12)
    assert not torch.allclose(reverse, forward, atol=1e-3)
