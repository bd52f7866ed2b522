"""marlflow.training.update's gradient accounting on toy tensors, marlflow.training.rollout's problem shares, and the trainer's
state_dict round trip (save -> load into a fresh trainer -> the same next step, bit for bit)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from marlflow.store.schema import VOLATILE_METRICS
from marlflow.tasks import register
from marlflow.tasks.toy import ToyMath
from marlflow.training import checkpoint
from marlflow.training import rollout as ro
from marlflow.training import update as upd


@register("parity")  # the same test task as test_trainer.py: reward variance in every group, real updates
class Parity(ToyMath):
    name = "parity"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


def _rg(role, g, f=1.0, slot_grads=(), **kw):
    rg = upd.RoleGrad(role, ["s"], calls=kw.pop("calls", 4), live=kw.pop("live", 4), f=f, g=torch.tensor(g))
    rg.slot_grads = [torch.tensor(s) for s in slot_grads]
    for k, v in kw.items():
        setattr(rg, k, v)
    return rg


def test_flat_grad_round_trips_and_fills_missing_grads_with_zeros():
    a, b = torch.zeros(2, 2, requires_grad=True), torch.zeros(3, requires_grad=True)
    a.grad = torch.arange(4.0).view(2, 2)
    assert torch.equal(upd.flat_grad([a, b]), torch.tensor([0.0, 1, 2, 3, 0, 0, 0]))
    upd.set_flat_grad([a, b], torch.arange(7.0))
    assert torch.equal(a.grad, torch.tensor([[0.0, 1], [2, 3]])) and torch.equal(
        b.grad, torch.tensor([4.0, 5, 6])
    )


def test_role_stats_norms_means_and_undefined_metrics_left_out():
    rg = _rg("gen", [3.0, 4.0], f=0.5, slot_grads=[[3.0, 0.0], [0.0, 4.0]], calls=4, live=2, loss=1.5,
             entropy=[0.2, 0.6], clip=[0.0, 0.2], kl=[0.1, 0.3], gap=0.4, gap_n=8)  # fmt: skip
    s = upd.role_stats(rg)
    assert s["grad_contrib_pre"] == 5.0 and s["grad_norm"] == 10.0 and s["live_frac"] == 0.5
    assert s["entropy"] == pytest.approx(0.4) and s["clip_frac"] == pytest.approx(0.1) and s["kl"] == 0.2
    assert s["logp_gap"] == 0.05 and s["slot_cos"] == 0.0  # orthogonal slots
    # ||sum|| / sqrt(sum ||g_s||^2) = 5 / 5: orthogonal slots add no amplification
    assert s["slot_amplification"] == pytest.approx(1.0)
    none = upd.role_stats(_rg("agg", [0.0, 0.0], f=0.0, live=0))
    assert none["grad_norm"] == 0.0 and not {"entropy", "kl", "logp_gap", "slot_cos"} & set(none)


def test_combine_and_sharing_stats():
    grads = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([-1.0, 1.0])}
    assert torch.equal(upd.combine(grads, {"a": 2.0, "b": 0.5}), torch.tensor([1.5, 0.5]))
    raw = grads["a"] + grads["b"]  # (0, 1)
    s = upd.sharing_stats(grads, raw)
    assert s["a"]["proj_share"] == pytest.approx(0.0) and s["b"]["proj_share"] == pytest.approx(1.0)
    assert s["a"]["cos_others"] == pytest.approx(-1 / math.sqrt(2))  # a against b
    assert "cos_others" not in upd.sharing_stats({"a": grads["a"]}, grads["a"])["a"]  # one role: undefined


def test_clipped_contributions_scale_each_role_by_its_policys_clip():
    got = upd.clipped_contributions({"p": 4.0, "q": 0.5}, {"p": ["a", "b"], "q": ["c"]},
                                    {"a": 3.0, "b": 2.0, "c": 0.5}, {"b": 0.5}, max_norm=1.0)  # fmt: skip
    assert got["a"] == (pytest.approx(0.25), pytest.approx(0.75))
    assert got["b"] == (pytest.approx(0.25), pytest.approx(0.25))
    assert got["c"][0] == 1.0 and got["c"][1] == 0.5  # under the threshold: unclipped


def test_scale_schedule_uses_the_schedulers_state_not_its_private_fields():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sched.step()
    upd.scale_schedule(opt, sched, [(opt.param_groups[0]["lr"] * 0.5, 0.05)], 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025) and sched.base_lrs == [0.05]
    opt.step()
    sched.step()
    assert sched.get_last_lr() == [pytest.approx(0.05 / 3)]  # the schedule goes on at half the rate


def test_a_steps_problems_shard_disjointly_and_in_order():
    # the step's problems are a pure function of (seed, step); distributed.shard splits them per rank
    from marlflow.training.distributed import shard

    problems = ro.step_problems(list(range(50)), seed=0, step=3, n=7)
    assert problems == ro.step_problems(list(range(50)), seed=0, step=3, n=7)  # a pure function
    shares = [shard(problems, r, 3) for r in range(3)]
    assert [x for s in shares for x in s] == problems and shard(problems, 0, 1) == problems
    with pytest.raises(ValueError, match="0 <= rank < world"):
        shard(problems, 3, 3)


def _step_rows(trainer, step):
    m = pd.DataFrame(trainer.metric_rows)
    m = m[(m.step == step) & ~m.metric.isin(VOLATILE_METRICS)]
    return m.sort_values(["split", "role", "metric"]).reset_index(drop=True)


@pytest.mark.slow
def test_state_dict_round_trip_gives_the_same_next_step(make_cfg, tmp_path):
    """A trainer's state_dict after step 1, loaded into a fresh trainer, gives the same step 2 (metrics and
    every adapter tensor) as the trainer it came from."""
    from peft import get_peft_model_state_dict

    from marlflow.cli.train import build_trainer

    cfg = make_cfg("voting", "ip", task="parity", steps=2, problems_per_step=4)
    a = build_trainer(cfg, tmp_path / "a")
    a.step = 1
    assert a.train_step(1)
    state = torch.load(_saved(a.state_dict(), tmp_path), weights_only=False)  # through bytes, as a checkpoint
    b = build_trainer(cfg, tmp_path / "b")  # reseeds torch: its RNG comes from the state too
    b.load_state_dict(state)
    assert b.step == 1 and b.metric_rows == a.metric_rows
    b.step = 2
    assert b.train_step(2)
    checkpoint.set_rng_state(state["rng"])  # the process RNG b consumed: a goes on from the same point
    a.step = 2
    assert a.train_step(2)
    first = _step_rows(a, 1)
    assert (first[first.metric == "grad_norm"].value > 0).any()  # AdamW has moments to carry into step 2
    pd.testing.assert_frame_equal(_step_rows(a, 2), _step_rows(b, 2))
    for p in cfg.policies:
        sa, sb = (get_peft_model_state_dict(t.model, adapter_name=p) for t in (a, b))
        assert all(torch.equal(sa[k], sb[k]) for k in sa), p


def _saved(state, tmp_path):
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path


def test_per_agent_block_gram_metrics_equal_the_padded_vectors():
    """Slot gradients on several adapters (sharing agent) kept unpadded with their block: slot_amplification and
    slot_cos equal those of the same vectors zero-padded into the joined space."""
    from marlflow.core import algos

    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(5, generator=g), torch.randn(5, generator=g), torch.randn(3, generator=g)]
    blocks = [0, 0, 1]  # two slots on the first adapter (5 parameters), one on the second (3)
    padded = [torch.cat([parts[0], torch.zeros(3)]), torch.cat([parts[1], torch.zeros(3)]),
              torch.cat([torch.zeros(5), parts[2]])]  # fmt: skip
    for fn in (algos.slot_amplification, algos.mean_pairwise_cosine):
        assert fn(parts, blocks) == pytest.approx(fn(padded), rel=1e-6), fn.__name__
    one_each = [parts[0], torch.cat([parts[1], parts[1][:1]])]  # one slot per adapter, different lengths
    assert algos.slot_amplification(one_each, [0, 1]) == pytest.approx(1.0)
    assert algos.mean_pairwise_cosine(one_each, [0, 1]) == 0.0
