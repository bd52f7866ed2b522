"""Unit tests of marlflow.interventions on toy tensors: the KL estimate, I6, same_role_norm, mass_balance, and
cliff_guard's decision on simulated eval curves; and of the kinds' registry (marlflow.core.intervention_spec):
the built-in specs, what an InterventionSpec refuses, and a kind registered from outside marlflow
(tests/interventions_extra/role_gain.py, which tests/test_interventions_train.py also trains a step with)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from marlflow import interventions as I
from marlflow.core import intervention_spec as ispec
from marlflow.core.definitions import ALPHA, TERMINAL_WINDOW
from marlflow.interventions.cliff_guard import guard_check, guard_observe
from marlflow.interventions.coherence import coherence_scale
from marlflow.interventions.common import gram, scaled_shares
from marlflow.interventions.mass_balance import mass_balance_scales
from marlflow.interventions.same_role_norm import same_role_scale


def _itv(spec: dict, workflow: str = "voting", steps: int = 120, eval_every: int = 10) -> I.Intervention:
    """The intervention `spec` (as RunConfig leaves it: checked, defaults in) builds, for a stand-in config."""
    grpo = SimpleNamespace(steps=steps, eval_every=eval_every)
    return I.build(SimpleNamespace(intervention_spec=spec, workflow=workflow, grpo=grpo))


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
    itv = _itv({"kind": "kl_anchor", "beta": {"aggregator": 0.05}})
    assert itv.role_beta("aggregator", 0.0) == pytest.approx(0.05)
    assert itv.role_beta("generator", 0.0) == 0.0
    assert itv.role_beta("aggregator", 0.01) == pytest.approx(0.06)
    assert _itv({"kind": "none"}).role_beta("aggregator", 0.02) == 0.02


def test_coherence_scales_by_one_minus_lambda_at_cos_one_and_leaves_cos_le_zero():
    g = torch.tensor([1.0, 2.0, -1.0])
    assert coherence_scale(g, 3 * g, 0.3) == pytest.approx(0.7)
    assert coherence_scale(g, -g, 0.3) == 1.0  # cos = -1
    assert coherence_scale(g, torch.tensor([2.0, -1.0, 0.0]), 0.3) == 1.0  # cos = 0
    assert coherence_scale(g, None, 0.3) == 1.0  # no history yet
    half = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])  # cos = 1/sqrt(2)
    assert coherence_scale(*half, 0.2) == pytest.approx(1 - 0.2 / math.sqrt(2))


def test_coherence_hook_uses_the_ema_and_commit_updates_it():
    spec = {"kind": "coherence", "lam": 0.3, "window": 4}
    itv = _itv(spec)
    st = itv.state
    g = {"generator": torch.tensor([1.0, 0.0]), "aggregator": torch.tensor([0.0, 2.0])}
    own = {"generator": 0.5, "aggregator": 0.5}
    assert itv.role_scales(g, own, {}) == {"generator": 1.0, "aggregator": 1.0}
    itv.commit(g, own)
    assert torch.equal(st.ema["generator"], torch.tensor([2.0, 0.0]))  # g / f starts the EMA
    s = itv.role_scales(g, own, {})
    assert s["generator"] == pytest.approx(0.7) and s["aggregator"] == pytest.approx(0.7)
    itv.commit({"generator": torch.tensor([0.0, 1.0])}, {"generator": 0.5})
    assert torch.allclose(
        st.ema["generator"],
        torch.tensor([2.0, 0.0]) + (torch.tensor([0.0, 2.0]) - torch.tensor([2.0, 0.0])) / 4,
    )
    restored = _itv(spec)
    restored.load_state_dict(itv.state_dict())
    assert torch.equal(restored.state.ema["generator"], st.ema["generator"])


def test_same_role_norm_makes_three_identical_voters_weigh_as_one():
    v = torch.tensor([0.3, -1.2, 0.5])
    slots = ["generator0", "generator1", "generator2"]
    g_role = v + v + v  # the role's gradient is the sum of its slots' gradients
    s = _itv({"kind": "same_role_norm"}).role_scales({"generator": g_role, "aggregator": v},
                      {"generator": 1.0, "aggregator": 1.0}, {"generator": slots, "aggregator": ["aggregator0"]})  # fmt: skip
    assert torch.allclose(s["generator"] * g_role, v)
    assert s["aggregator"] == 1.0
    assert same_role_scale("orch_workers", "worker", ["worker0", "worker1"]) == 0.5
    assert same_role_scale("orch_workers", "orchestrator", ["orchestrator0"]) == 1.0
    assert same_role_scale("eval_opt", "generator", ["generator0", "generator1"]) == 1.0  # sequential rounds


@pytest.mark.parametrize("cap", [0.5, 0.6, 0.8])
def test_mass_balance_caps_shares(cap):
    torch.manual_seed(0)
    big = torch.randn(50) * 10
    grads = [big, torch.randn(50) + 0.1 * big, torch.randn(50)]
    G = gram(grads)
    before = scaled_shares(G, torch.ones(3))
    assert before.max() > cap  # the dominant role is over the cap to begin with
    a = mass_balance_scales(G, cap)
    after = scaled_shares(G, a)
    assert after.max() <= cap + 1e-5 and after.sum() == pytest.approx(1.0)
    assert ((a > 0) & (a <= 1)).all()
    # independent check on the flat vectors: <a_r g_r, g> / ||g||^2
    total = sum(x * g for x, g in zip(a.float(), grads))
    direct = [float(x * torch.dot(g, total) / torch.dot(total, total)) for x, g in zip(a.float(), grads)]
    assert max(direct) <= cap + 1e-4


def test_mass_balance_leaves_balanced_roles_alone():
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]
    a = mass_balance_scales(gram(grads), 0.6)
    assert torch.equal(a, torch.ones(2, dtype=torch.float64))
    s = _itv({"kind": "mass_balance", "cap": 0.6}).role_scales(
        {"generator": grads[0], "aggregator": grads[1]}, {}, {}
    )
    assert s == {"generator": 1.0, "aggregator": 1.0}


# ---------------------------------------------------------------- cliff_guard

GUARD = {"kind": "cliff_guard", "max_restores": 2, "lr_factor": 0.5, "window": 3, "alpha": 0.04}


def _curve(accs, n=200):
    return [(10 * k, a, n) for k, a in enumerate(accs)]


def _online(accs, n, spec=GUARD, looks=None):
    """The trainer's use of the guard on one curve, without weights: the steps at which it restores."""
    st, fired = I.State(), []
    for step, acc, m in _curve(accs, n):
        if guard_observe(st, step, acc, m):
            st.best = {"step": step, "acc": acc, "n": m}
            continue
        if guard_check(st.evals, st.restores, spec, looks or len(accs) - 1)["fire"]:
            fired.append(step)
            st.restores += 1
            st.evals = [(st.best["step"], st.best["acc"], st.best["n"])]
    return fired


def test_guard_defaults_are_the_analysis_constants():
    params = ispec.spec_of("cliff_guard").params
    assert params["window"].default == TERMINAL_WINDOW and params["alpha"].default == ALPHA


def test_guard_fires_on_a_clear_late_drop_and_respects_max_restores():
    evals = _curve([0.5, 0.6, 0.62, 0.61, 0.6, 0.62, 0.4, 0.38])
    r = guard_check(evals, 0, GUARD, looks=12)
    assert r["cliff"] and r["fire"] and r["drop"] > r["drop_z"] * r["drop_se"]
    assert r["drop_z"] > guard_check(evals, 0, GUARD, looks=1)["drop_z"]  # alpha is split over the looks
    r = guard_check(evals, 2, GUARD, looks=12)
    assert r["cliff"] and not r["fire"]  # still detected (and logged), but no restore left
    assert guard_check(evals, 2, {**GUARD, "max_restores": 3}, looks=12)["fire"]
    # the same drop without the last two evals, or a last eval as good as the best, is no cliff
    assert not guard_check(evals[:6], 0, GUARD, looks=12)["cliff"]
    assert not guard_check(_curve([0.9, 0.1, 0.1, 0.9]), 0, GUARD, looks=3)["cliff"]
    assert not guard_check(evals[:1], 0, GUARD, looks=12)["cliff"]


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
    assert guard_observe(st, 0, 0.5, 10)
    st.best = {"step": 0, "acc": 0.5, "n": 10}
    assert not guard_observe(st, 1, 0.5, 10) and not guard_observe(st, 2, 0.4, 10)
    assert guard_observe(st, 3, 0.6, 10)
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
    """What TRL's use_bias_correction_kl (set to True in marlflow.training.trl_loss.grpo_args) does to the KL term's
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


# ---------------------------------------------------------------- the hooks of none and cliff_guard


def _evaluated(step, acc, copies, restores):
    """An Evaluated with one validation eval at `step` (n=200); snapshot returns a numbered copy of the
    'weights', restore records what it was given."""
    rows = [{"step": step, "split": "val", "role": "all", "metric": m, "value": v}
            for m, v in (("accuracy", acc), ("n_eval", 200.0))]  # fmt: skip
    rows.append({"step": step, "split": "eval", "role": "all", "metric": "accuracy", "value": 1 - acc})

    def snapshot():
        copies.append(step)
        return {"adapters": {"p": step}, "optimizers": {"p": step}}

    return I.Evaluated(step, rows, snapshot, lambda copy, f: restores.append((copy["adapters"]["p"], f)))


def test_none_hooks_change_nothing_and_every_other_kind_reports_a_factor_per_role():
    """Kind none: no factor (no itv_scale is logged), no gradient kept, after_eval reads nothing; kinds that
    leave gradients alone (kl_anchor, cliff_guard) still report factor 1 for every role."""
    none, g = _itv({"kind": "none"}), {"generator": torch.ones(2), "aggregator": torch.ones(2)}
    assert type(none) is I.NoIntervention and none.role_scales(g, {}, {}) is None
    assert not none.keeps_grads and not none.reads_evals
    none.commit({"generator": None}, {"generator": 1.0})
    assert none.after_eval(I.Evaluated(3, [], None, None)) == {}
    assert none.state_dict() == I.State().state_dict()  # one checkpoint format for every kind
    kl = _itv({"kind": "kl_anchor", "beta": {"aggregator": 0.05}})
    assert kl.role_scales(g, {}, {}) == {"generator": 1.0, "aggregator": 1.0} and kl.keeps_grads


def test_cliff_guard_after_eval_keeps_the_best_and_restores_it_on_a_cliff():
    """The trainer's former _cliff_guard, driven through the hook: a copy at each new best, a restore of the
    best copy (learning rate x lr_factor) on each cliff, at the steps `_online` finds, and the logged values."""
    accs = [0.3, 0.6, 0.6, 0.3, 0.6, 0.6, 0.3, 0.3, 0.3, 0.3]
    guard = _itv({**GUARD, "lr_factor": 0.25}, steps=90, eval_every=10)  # 9 looks, as _online(accs) has
    assert guard.reads_evals
    copies, restores, logged = [], [], {}
    for step, acc, _ in _curve(accs):
        got = guard.after_eval(_evaluated(step, acc, copies, restores))
        if got:
            logged[step] = got
    assert copies == [0, 10] and restores == [(10, 0.25), (10, 0.25)]
    assert [s for s, v in logged.items() if "guard_restore" in v] == _online(accs, 200) == [30, 60]
    assert logged[60]["guard_restores"] == 2 and logged[60]["guard_lr_scale"] == 0.25**2
    assert logged[60]["guard_restore"] == 10 and logged[60]["guard_drop"] > 0
    assert guard.state.restores == 2 and guard.state.best["step"] == 10
    with pytest.raises(KeyError):  # no validation rows for the step: the guard never reads the test rows
        guard.after_eval(I.Evaluated(100, [{**r, "split": "eval"} for r in _evaluated(100, 0.9, [], [])
                                           .rows], None, None))  # fmt: skip


# ---------------------------------------------------------------- the registry

TESTS = Path(__file__).parent
ROLE_GAIN = "interventions_extra.role_gain"
# The table RunConfig checked definitions against before the kinds had specs: the specs must give it back,
# so that every existing definition checks, fills in defaults and hashes as before.
TABLE = {
    "none": {},
    "kl_anchor": {"beta": ("roles", {"minimum": 0, "maximum": 100}, None)},
    "coherence": {
        "lam": ("float", {"exclusiveMinimum": 0, "maximum": 1}, 0.3),
        "window": ("int", {"minimum": 1, "maximum": 1_000_000}, 128),
    },
    "same_role_norm": {},
    "mass_balance": {"cap": ("float", {"exclusiveMinimum": 0, "maximum": 1}, 0.6)},
    "cliff_guard": {
        "max_restores": ("int", {"minimum": 1, "maximum": 1000}, 2),
        "lr_factor": ("float", {"exclusiveMinimum": 0, "maximum": 1}, 0.5),
        "window": ("int", {"minimum": 1, "maximum": 1000}, 3),
        "alpha": ("float", {"exclusiveMinimum": 0, "maximum": 0.5}, 0.04),
    },
}


def use_role_gain(monkeypatch) -> ispec.InterventionSpec:
    """The role_gain kind (tests/interventions_extra) registered the documented way (MARLFLOW_INTERVENTIONS),
    for the calling test only."""
    monkeypatch.setattr(ispec, "_REGISTERED", {})  # registrations of this test do not outlive it
    monkeypatch.setenv(ispec.ENV_VAR, ROLE_GAIN)
    monkeypatch.syspath_prepend(str(TESTS))
    return ispec.spec_of("role_gain")


@pytest.fixture
def role_gain(monkeypatch):
    return use_role_gain(monkeypatch)


def test_builtin_specs_give_back_the_table_and_each_names_its_module():
    assert ispec.kinds()[: len(TABLE)] == tuple(TABLE)  # a new kind goes after these (schema, messages)
    as_table = {
        k: {p: (q.type, dict(q.bounds), q.default) for p, q in ispec.spec_of(k).params.items()} for k in TABLE
    }
    assert as_table == TABLE
    for kind in TABLE:
        spec = ispec.spec_of(kind)
        assert spec.hooks.startswith(f"marlflow.interventions.{'common' if kind == 'none' else kind}:")
        assert I.common.hooks_class(spec).__module__ == spec.hooks.partition(":")[0]
    assert [k for k in TABLE if ispec.spec_of(k).sharings != ("sp", "ip")] == ["mass_balance"]
    with pytest.raises(ispec.InterventionError, match="kind 'magic' is unknown"):
        ispec.spec_of("magic")


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(name="Bad"), "name must be lower case"),
        (dict(help=""), "help is empty"),
        (dict(hooks="no_colon"), "hooks must be 'module:Class'"),
        (dict(sharings=("sp",)), "say why in sharing_note"),
        (dict(sharings=("xp",), sharing_note="x"), "sharings must be some of"),
        (dict(params={"kind": ispec.Param("int", {"minimum": 0, "maximum": 1})}), "'kind' names the kind"),
    ],
)
def test_a_bad_spec_is_refused(kw, msg):
    base = dict(name="x", help="h", hooks="m:C")
    with pytest.raises(ispec.InterventionError, match=msg):
        ispec.InterventionSpec(**{**base, **kw})


def test_a_bad_param_is_refused():
    with pytest.raises(ispec.InterventionError, match="type 'str'"):
        ispec.Param("str", {"minimum": 0, "maximum": 1})
    with pytest.raises(ispec.InterventionError, match="one lower bound"):
        ispec.Param("int", {"minimum": 0, "exclusiveMinimum": 0, "maximum": 1})
    with pytest.raises(ispec.InterventionError, match="outside its bounds"):
        ispec.Param("float", {"exclusiveMinimum": 0, "maximum": 1}, 0)


def test_register_refuses_a_second_spec_under_a_known_name(monkeypatch):
    monkeypatch.setattr(ispec, "_REGISTERED", {})
    with pytest.raises(ispec.InterventionError, match="'coherence' is already registered"):
        ispec.register(dataclasses.replace(ispec.spec_of("coherence"), help="another"))
    spec = ispec.register(ispec.InterventionSpec(name="half", help="h", hooks="builtins:object"))
    assert ispec.register(spec) is spec and ispec.kinds()[-1] == "half"
    with pytest.raises(ispec.InterventionError, match="builtins:object' is not a subclass"):
        _itv({"kind": "half"})


def test_a_kind_from_outside_marlflow_is_checked_by_runconfig_and_built(role_gain):
    """role_gain is registered through MARLFLOW_INTERVENTIONS only: nothing in src/ names it. RunConfig checks
    its definitions as it checks the built-in kinds', the matrix schema lists it, and build() makes its hooks."""
    from marlflow.core.config import ConfigError, GRPOParams, RunConfig, TaskSpec
    from marlflow.pipeline.matrix import schema

    assert not [p for p in (TESTS.parent / "src").rglob("*.py") if '"role_gain"' in p.read_text()]
    cfg = RunConfig(run_id="voting-ip-toy-math-s0", workflow="voting", sharing="ip", scale="toy", task_axis="math",
                    seed=0, task=TaskSpec(name="toy_math", eval_size=4, train_size=50), model="toy",
                    grpo=GRPOParams(steps=2, eval_every=1))  # fmt: skip
    mute = dataclasses.replace(
        cfg, intervention="mute", intervention_spec={"kind": "role_gain", "gain": {"generator": 0}}
    )
    assert mute.intervention_spec == {"kind": "role_gain", "gain": {"generator": 0}}
    for spec, msg in [({"kind": "role_gain"}, "gain is required"),
                      ({"kind": "role_gain", "gain": {"generator": 2}}, r"gain\.generator is 2; it must be a number >= 0"),
                      ({"kind": "role_gain", "gain": {"judge": 0}}, "judge is not a role type"),
                      ({"kind": "role_gain", "gain": {"generator": 0}, "cap": 1}, "cap is not a parameter")]:  # fmt: skip
        with pytest.raises(ConfigError, match=msg):
            dataclasses.replace(cfg, intervention="mute", intervention_spec=spec)
    assert "role_gain" in schema()["$defs"]["intervention_def"]["properties"]["kind"]["enum"]
    itv = I.build(mute)
    assert type(itv).__name__ == "RoleGain" and itv.spec is mute.intervention_spec
    g = {"generator": torch.ones(2), "aggregator": torch.ones(2)}
    assert itv.role_scales(g, {}, {}) == {"generator": 0.0, "aggregator": 1.0}


def test_a_module_named_in_the_environment_must_exist_and_hold_a_spec(monkeypatch):
    monkeypatch.setattr(ispec, "_REGISTERED", {})
    monkeypatch.setenv(ispec.ENV_VAR, "no_such_module_xyz")
    with pytest.raises(ispec.InterventionError, match="module 'no_such_module_xyz' cannot be imported"):
        ispec.kinds()
    monkeypatch.setenv(ispec.ENV_VAR, "marlflow.interventions.coherence")
    with pytest.raises(ispec.InterventionError, match="has no SPEC"):
        ispec.kinds()
