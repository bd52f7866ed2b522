"""Gradient metrics and eval rows of real trainer steps on the toy model.

The pure functions (own_scale, projection_shares, slot_amplification, ...) are tested on synthetic tensors
in test_algos.py; here a real TRL step of the toy model must log them with the meaning
marlflow.core.definitions gives: grad_norm = the gradient norm of the role's own mean loss (the number IP
would see for the same calls), proj_share summing to 1 over a policy's roles, the slot amplification of
Voting's generators, the clip coefficient and the contributions before and after clipping, and ema_cos from
the second step on. Reference gradients are computed with TRL's `_compute_loss` directly on the same calls.
Uses the `parity` test task (as test_trainer.py) (reward = output length is odd), so groups have reward variance.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from marlflow.cli.train import build_trainer
from marlflow.core import algos
from marlflow.core.definitions import solution_marker
from marlflow.tasks import register
from marlflow.tasks.toy import ToyMath
from marlflow.training.evaluation import EVAL_SEED_OFFSET
from marlflow.training.update import flat_grad
from marlflow.workflows import rollout


@register("parity")  # the same test task as test_trainer.py and parity_train.py
class Parity(ToyMath):
    name = "parity"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


def _step_calls(trainer, step=1):
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(step), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    return calls, adv


def _grad(trainer, policy, calls, adv, num_items, weight=1.0) -> torch.Tensor:
    """Flat gradient of weight * TRL's loss on `calls` alone, computed from zero grads and cleared after."""
    trainer.model.set_adapter(policy)
    trainer.model.train()
    st = trainer.policies[policy]
    st.optimizer.zero_grad(set_to_none=True)
    (trainer.trl.loss(trainer.model, trainer.collate(calls, adv, num_items), 0.0).loss * weight).backward()
    flat = flat_grad(st.params).clone()
    st.optimizer.zero_grad(set_to_none=True)
    return flat


def _train_rows(trainer) -> pd.Series:
    m = pd.DataFrame(trainer.metric_rows)
    return m[m.split == "train"].set_index(["step", "role", "metric"]).value


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_sp_role_metrics_match_direct_gradients(make_cfg, tmp_path, loss_type):
    """Voting SP: each role's grad_norm is the norm of its own mean-loss gradient (what IP computes on the
    same calls), proj_share and slot_amplification match gradients computed role by role and slot by slot."""
    trainer = build_trainer(make_cfg("voting", "sp", task="parity", loss_type=loss_type), tmp_path)
    calls, adv = _step_calls(trainer)
    tok_pol = sum(len(c.completion_ids) for c in calls)
    own, weighted, slots = {}, {}, {}
    for role in ("generator", "aggregator"):
        idx = [i for i, c in enumerate(calls) if c.role == role]
        rc = [calls[i] for i in idx]
        tok = sum(len(c.completion_ids) for c in rc)
        assert adv[idx].abs().sum() > 0, f"{role} has no advantage: the parity task should give variance"
        own[role] = _grad(trainer, "shared", rc, adv[idx], tok).norm().item()
        w = algos.role_loss_weight(loss_type, len(idx), len(calls), tok, tok_pol)
        weighted[role] = _grad(trainer, "shared", rc, adv[idx], tok_pol, w)
    for slot in ("generator0", "generator1", "generator2"):
        idx = [i for i, c in enumerate(calls) if c.slot == slot]
        tok = sum(len(calls[i].completion_ids) for i in idx)
        w = algos.role_loss_weight(loss_type, len(idx), len(calls), tok, tok_pol)
        slots[slot] = _grad(trainer, "shared", [calls[i] for i in idx], adv[idx], tok_pol, w)

    stats = trainer.update(calls, adv)
    total = weighted["generator"] + weighted["aggregator"]
    for role in ("generator", "aggregator"):
        s = stats[role]
        assert s["grad_norm"] == pytest.approx(own[role], rel=1e-3)
        assert s["grad_contrib_pre"] == pytest.approx(weighted[role].norm().item(), rel=1e-3)
        expected_share = torch.dot(weighted[role], total).item() / torch.dot(total, total).item()
        assert s["proj_share"] == pytest.approx(expected_share, rel=1e-3, abs=1e-5)
        rest = total - weighted[role]
        assert s["cos_others"] == pytest.approx(algos.cosine(weighted[role], rest), abs=1e-3)
        c = algos.clip_coef(total.norm().item(), trainer.cfg.grpo.max_grad_norm)
        assert s["clip_coef"] == pytest.approx(c, rel=1e-3)
        assert s["grad_contrib_post"] == pytest.approx(c * s["grad_contrib_pre"], rel=1e-6)
        assert "ema_cos" not in s  # the first non-zero gradient only starts the EMA
    assert stats["generator"]["proj_share"] + stats["aggregator"]["proj_share"] == pytest.approx(
        1.0, abs=1e-5
    )
    assert stats["generator"]["slot_amplification"] == pytest.approx(
        algos.slot_amplification(list(slots.values())), rel=1e-3
    )
    assert stats["generator"]["slot_cos"] == pytest.approx(
        algos.mean_pairwise_cosine(list(slots.values())), abs=1e-3
    )
    assert "slot_amplification" not in stats["aggregator"]  # one slot
    post = stats["generator"]["grad_contrib_post"] + stats["aggregator"]["grad_contrib_post"]
    for role in ("generator", "aggregator"):
        assert stats[role]["grad_share"] == pytest.approx(stats[role]["grad_contrib_post"] / post)
    assert set(trainer.grad_ema) == {"generator", "aggregator"}


@pytest.mark.slow
@pytest.mark.parametrize("sharing", ["sp", "ip"])
def test_voting_steps_log_every_gradient_metric(make_cfg, tmp_path, sharing):
    """Real train steps: every metric is in the metrics rows, proj_share sums to 1 per policy, and ema_cos is
    the cosine of the step's own-loss gradient with the EMA as ema_update moves it (window 4). A step where a
    role has no gradient (all its groups without reward variance) leaves its EMA as it was."""
    trainer = build_trainer(
        make_cfg("voting", sharing, task="parity", steps=4, problems_per_step=3, grad_ema_window=4), tmp_path
    )
    roles, emas, checked = ("generator", "aggregator"), [{}], 0
    for step in range(1, 5):
        trainer.train_step(step)
        emas.append({r: t.clone() for r, t in trainer.grad_ema.items()})
    m = _train_rows(trainer)
    assert m[(1, "generator", "grad_norm")] > 0 and m[(1, "aggregator", "grad_norm")] > 0
    for step in range(1, 5):
        live = [r for r in roles if m[(step, r, "grad_norm")] > 0]
        for r in roles:
            c, pre, post = (m[(step, r, k)] for k in ("clip_coef", "grad_contrib_pre", "grad_contrib_post"))
            assert 0 < c <= 1 and post == pytest.approx(c * pre)
        total = sum(m[(step, r, "grad_contrib_post")] for r in roles)
        for r in live:
            assert m[(step, r, "grad_share")] == pytest.approx(m[(step, r, "grad_contrib_post")] / total)
        if sharing == "sp" and live:
            assert sum(m[(step, r, "proj_share")] for r in roles) == pytest.approx(1.0, abs=1e-5)
        if sharing == "sp" and len(live) == 2:
            assert all(-1 - 1e-6 <= m[(step, r, "cos_others")] <= 1 + 1e-6 for r in roles)
        if sharing == "ip":  # one role per policy: its gradient is the whole policy gradient
            assert all(m[(step, r, "proj_share")] == pytest.approx(1.0, abs=1e-5) for r in live)
            assert not any((step, r, "cos_others") in m.index for r in roles)
        if (step, "generator", "slot_amplification") in m.index:
            assert 0 < m[(step, "generator", "slot_amplification")] <= math.sqrt(3) + 1e-6
            assert -1 - 1e-6 <= m[(step, "generator", "slot_cos")] <= 1 + 1e-6
        for r in roles:
            before, after = emas[step - 1].get(r), emas[step].get(r)
            if r not in live:
                assert (step, r, "ema_cos") not in m.index
                assert (before is None and after is None) or torch.equal(before, after)
            elif before is None:  # the first gradient starts the EMA: nothing to compare it with
                assert (step, r, "ema_cos") not in m.index and after is not None
            else:
                g = before + (after - before) * 4  # this step's own-loss gradient (ema_update, window 4)
                assert g.norm().item() == pytest.approx(m[(step, r, "grad_norm")], rel=1e-3)
                assert m[(step, r, "ema_cos")] == pytest.approx(algos.cosine(g, before), abs=1e-4)
                checked += 1
    assert (1, "generator", "slot_amplification") in m.index
    assert checked >= 1, "no step compared a gradient with its EMA; pick a seed or more steps"


def test_single_grad_norm_is_the_whole_batch_gradient(make_cfg, tmp_path):
    """`single` has one role: its grad_norm under the SP adapter equals the norm of TRL's loss gradient on
    the whole batch (what a separate adapter, IP, computes), and proj_share is 1."""
    trainer = build_trainer(make_cfg("single", "sp", task="parity"), tmp_path)
    calls, adv = _step_calls(trainer)
    assert adv.abs().sum() > 0
    ref = _grad(trainer, "shared", calls, adv, sum(len(c.completion_ids) for c in calls)).norm().item()
    stats = trainer.update(calls, adv)
    assert stats["generator"]["grad_norm"] == pytest.approx(ref, rel=1e-4)
    assert stats["generator"]["grad_contrib_pre"] == pytest.approx(ref, rel=1e-4)
    assert stats["all"]["grad_norm"] == pytest.approx(ref, rel=1e-4)
    assert stats["generator"]["proj_share"] == pytest.approx(1.0, abs=1e-6)
    assert stats["generator"]["grad_share"] == pytest.approx(1.0)


def test_a_role_without_gradient_logs_no_undefined_metric(make_cfg, tmp_path):
    """Zero-advantage calls are not run: a role whose calls all have zero advantage has no gradient. Its
    grad_norm is 0, metrics that are undefined (cosines, amplification, ema_cos) are absent, nothing crashes,
    and its EMA is not started."""
    trainer = build_trainer(make_cfg("voting", "sp", task="parity"), tmp_path)
    calls, adv = _step_calls(trainer)
    adv = adv.clone()
    adv[[i for i, c in enumerate(calls) if c.role == "aggregator"]] = 0.0
    adv[[i for i, c in enumerate(calls) if c.slot in ("generator1", "generator2")]] = 0.0
    stats = trainer.update(calls, adv)
    agg, gen = stats["aggregator"], stats["generator"]
    assert agg["grad_norm"] == 0 and agg["grad_contrib_post"] == 0 and agg["live_frac"] == 0
    assert agg["proj_share"] == 0 and gen["proj_share"] == pytest.approx(1.0, abs=1e-6)
    assert not {"cos_others", "ema_cos", "slot_amplification"} & set(agg)
    assert "slot_amplification" not in gen and "slot_cos" not in gen  # one slot with a gradient
    assert gen["grad_norm"] > 0 and gen["grad_share"] == pytest.approx(1.0)
    assert set(trainer.grad_ema) == {"generator"}


def test_grad_ema_is_checkpointed(make_cfg, tmp_path):
    trainer = build_trainer(make_cfg("voting", "ip", task="parity", steps=1), tmp_path)
    trainer.step = 1
    trainer.train_step(1)
    trainer.save_checkpoint()
    again = build_trainer(make_cfg("voting", "ip", task="parity", steps=1), tmp_path)
    assert again.grad_ema == {} and again.restore()
    assert set(again.grad_ema) == set(trainer.grad_ema) == {"generator", "aggregator"}
    for r, t in trainer.grad_ema.items():
        assert torch.equal(again.grad_ema[r], t)


def test_eval_rows_for_cross_fitting_and_capture(make_cfg, tmp_path):
    """evaluate() logs the two fixed halves of the eval set (even / odd problem index) and, for the
    supervisory role only, the share of all its eval calls with a solution marker, with the call counts."""
    trainer = build_trainer(make_cfg("voting", "sp", task="parity"), tmp_path)
    m = pd.DataFrame(trainer.evaluate_workflow(0).metric_rows)
    ev = m[m.split == "eval"].set_index(["role", "metric"]).value
    # the same evaluation replayed (evaluate's seeding), to know every eval output
    seed = trainer.cfg.seed + EVAL_SEED_OFFSET
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        ctx = trainer._ctx(trainer.cfg.grpo.eval_temperature, seed=seed)
        episodes = rollout(trainer.cfg, trainer.task, trainer.eval_problems, ctx, 1)
    assert [e.problem.uid for e in episodes] == [p.uid for p in trainer.eval_problems]
    rewards = [e.reward for e in episodes]
    assert ev[("all", "accuracy")] == pytest.approx(sum(rewards) / 6)  # the replay is the same evaluation
    assert (ev[("all", "n_eval")], ev[("all", "n_eval_a")], ev[("all", "n_eval_b")]) == (6, 3, 3)
    assert ev[("all", "accuracy_a")] == pytest.approx(sum(rewards[0::2]) / 3)
    assert ev[("all", "accuracy_b")] == pytest.approx(sum(rewards[1::2]) / 3)
    agg = [c.text for e in episodes for c in e.calls if c.role == "aggregator"]
    assert (
        ev[("generator", "calls")] == 6 * trainer.cfg.n_votes and ev[("aggregator", "calls")] == len(agg) == 6
    )
    expected = sum(solution_marker("voting", t) for t in agg) / 6
    lengths = [len(c.completion_ids) for e in episodes for c in e.calls if c.role == "aggregator"]
    assert ev[("aggregator", "completion_length")] == pytest.approx(np.mean(lengths))
    assert ev[("aggregator", "completion_length_sd")] == pytest.approx(np.std(lengths, ddof=1))
    assert ev[("aggregator", "solution_marker_share")] == pytest.approx(expected)
    assert ("generator", "solution_marker_share") not in ev.index


def test_single_logs_no_marker_share(make_cfg, tmp_path):
    trainer = build_trainer(make_cfg("single", "sp", task="parity"), tmp_path)
    m = pd.DataFrame(trainer.evaluate_workflow(0).metric_rows)
    assert "solution_marker_share" not in set(m.metric)
    assert m[(m.role == "generator") & (m.metric == "calls")].value.item() == 6


def test_grad_metrics_every_samples_the_vector_metrics(make_cfg, tmp_path):
    """grpo.grad_metrics_every=2: step 1 logs the per-role norms, contributions, clip_coef and grad_share but
    none of the metrics that need per-slot or whole-vector work, and does not start the EMA."""
    trainer = build_trainer(make_cfg("voting", "sp", task="parity", grad_metrics_every=2), tmp_path)
    trainer.train_step(1)
    m = _train_rows(trainer)
    logged = set(m.loc[1].index)
    for r in ("generator", "aggregator"):
        assert {(r, k) for k in ("grad_norm", "grad_contrib_pre", "grad_contrib_post", "clip_coef")} <= logged
        assert not {(r, k) for k in ("proj_share", "cos_others", "slot_amplification", "ema_cos")} & logged
    assert m[(1, "generator", "grad_norm")] > 0 and trainer.grad_ema == {}


@pytest.mark.parametrize("field", ["grad_ema_window", "grad_metrics_every"])
@pytest.mark.parametrize("value", [0, -3, 1.5, True])
def test_bad_gradient_metric_settings_are_refused(field, value):
    from marlflow.core.config import ConfigError, GRPOParams

    with pytest.raises(ConfigError, match=f"grpo.{field}"):
        GRPOParams(**{field: value})
