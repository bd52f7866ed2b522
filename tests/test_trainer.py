"""Real TRL training steps on the toy model for every workflow x sharing.

A test-only task, `parity` (reward = output length is odd), guarantees reward variance inside GRPO groups
even for a barely trained model, so every step has non-zero advantages and real gradients.
"""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch

from marlflow.cli.train import build_trainer, run
from marlflow.core import algos
from marlflow.core.workflow_spec import spec_of
from marlflow.store.schema import METRIC_COLUMNS, validate_metrics
from marlflow.tasks import Problem, register
from marlflow.tasks.toy import ToyMath
from marlflow.training.update import pieces
from marlflow.workflows import Call, Episode, rollout


@register("parity")
class Parity(ToyMath):
    name = "parity"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


CELLS = [("single", "sp"), ("eval_opt", "sp"), ("eval_opt", "ip"), ("voting", "sp"), ("voting", "ip"),
         ("orch_workers", "sp"), ("orch_workers", "ip"), ("voting", "agent"), ("orch_workers", "agent")]  # fmt: skip


def _adapter_b(ckpt_dir, policy):
    from safetensors.torch import load_file

    sub = (
        ckpt_dir / "adapters" / policy if (ckpt_dir / "adapters" / policy).exists() else ckpt_dir / "adapters"
    )
    sd = load_file(sub / "adapter_model.safetensors")
    return {k: v for k, v in sd.items() if "lora_B" in k}


@pytest.mark.parametrize("workflow,sharing", CELLS)
def test_two_step_run(make_cfg, tmp_path, workflow, sharing):
    cfg = make_cfg(workflow, sharing, task="parity")
    metrics = run(cfg, tmp_path)
    # outputs and schema
    assert (tmp_path / "DONE").exists() and json.loads((tmp_path / "DONE").read_text())["steps"] == 2
    on_disk = pd.read_parquet(tmp_path / "metrics.parquet")
    assert list(on_disk.columns) == METRIC_COLUMNS
    validate_metrics(on_disk)
    assert not on_disk.duplicated(["step", "split", "role", "metric"]).any()
    # loss computed for every role type, gradients flowed
    train = on_disk[on_disk.split == "train"]
    for role in cfg.role_types:
        r = train[train.role == role].set_index(["step", "metric"]).value
        assert set(r.index.get_level_values("step")) == {1, 2}
        assert r.xs("samples", level="metric").min() > 0
        assert torch.isfinite(torch.tensor(r.xs("loss", level="metric").values)).all()
    assert train[(train.role == "all") & (train.metric == "grad_norm")].value.max() > 0
    assert train[(train.role == "all") & (train.metric == "nan_skipped")].value.sum() == 0
    evals = on_disk[(on_disk.split == "eval") & (on_disk.metric == "accuracy") & (on_disk.role == "all")]
    assert evals.step.tolist() == [0, 1, 2]
    # every policy's adapter moved away from its zero-initialised B: each that a mandatory slot trains (under
    # agent, Orch-Workers' worker1.. run only in episodes whose orchestrator gave that many strategies)
    ckpt = tmp_path / "checkpoints" / "step-2"
    spec = spec_of(workflow)
    trained = {cfg.policy_of(c.role, c.slot) for st in spec.stages(cfg, cfg.task_axis) for c in st
               if spec.is_mandatory(c.slot)}  # fmt: skip
    assert trained == set(cfg.policies) or sharing == "agent"
    for policy in trained:
        assert any(v.abs().sum() > 0 for v in _adapter_b(ckpt, policy).values()), policy
    assert len(metrics) == len(on_disk)


EXPECTED_CALLS = {"single": 1, "voting": 2, "orch_workers": 3}


@pytest.mark.slow
@pytest.mark.parametrize("workflow", ["single", "voting", "orch_workers", "eval_opt"])
def test_generation_is_batched_per_stage(make_cfg, tmp_path, workflow):
    """One generate call per policy per stage, whatever the number of episodes."""
    for sharing in ("sp", "ip") if workflow != "single" else ("sp",):
        trainer = build_trainer(make_cfg(workflow, sharing, task="parity", problems_per_step=3), tmp_path)
        trainer.train_step(1)
        m = pd.DataFrame(trainer.metric_rows)
        calls = m[m.metric == "generate_calls"].value.item()
        if workflow == "eval_opt":
            assert 2 <= calls <= 6  # generator + evaluator per round, at most 3 rounds for math
        else:
            assert calls == EXPECTED_CALLS[workflow]


def _update_grads(trainer, calls, adv) -> dict:
    """policy -> the flat gradient update() hands its optimizer (after clipping), with the optimizer steps
    replaced by a record, so the weights stay where they are for the next call."""
    got = {}
    for p, st in trainer.policies.items():
        st.optimizer.step = lambda p=p: got.__setitem__(
            p, torch.cat([t.grad.flatten() for t in trainer.policies[p].params]).clone()
        )
    try:
        trainer.update(calls, adv)
    finally:
        for st in trainer.policies.values():
            del st.optimizer.step  # the instance attribute; the class's step is back
    return got


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def test_ip_gradients_are_isolated_with_both_policies_active(make_cfg, tmp_path):
    """Both IP policies in one update: each adapter's gradient is the one its own role's calls give alone
    (no leakage through the shared forward, the batching or the loss normaliser), and it is not zero."""
    trainer = build_trainer(make_cfg("voting", "ip", task="parity", max_grad_norm=1e6), tmp_path)
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    both = _update_grads(trainer, calls, adv)
    assert set(both) == {"generator", "aggregator"}
    for role in both:
        own = [i for i, c in enumerate(calls) if c.role == role]
        alone = _update_grads(trainer, [calls[i] for i in own], adv[own])
        assert set(alone) == {role}  # the other policy got no gradient at all
        assert both[role].norm() > 0 and _rel(both[role], alone[role]) < 1e-5, role


def test_ip_update_touches_only_its_own_adapter(make_cfg, tmp_path):
    trainer = build_trainer(make_cfg("voting", "ip", task="parity"), tmp_path)
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    only = [i for i, c in enumerate(calls) if c.role == "aggregator"]
    assert adv[only].abs().sum() > 0
    before = {p: [t.detach().clone() for t in st.params] for p, st in trainer.policies.items()}
    trainer.update([calls[i] for i in only], adv[only])
    changed = {
        p: any(not torch.equal(a, b) for a, b in zip(before[p], trainer.policies[p].params)) for p in before
    }
    assert changed == {"generator": False, "aggregator": True}


def test_per_agent_policies_are_the_agents_and_each_gets_only_its_own_calls(make_cfg, tmp_path):
    """Sharing 'agent': one adapter per voter and one for the aggregator; every GRPO group trains one of them,
    each adapter's gradient is the one its own calls give alone (no leak through the shared forward, the
    batching or the normaliser), and the others get none."""
    trainer = build_trainer(make_cfg("voting", "agent", task="parity", max_grad_norm=1e6), tmp_path)
    cfg = trainer.cfg
    assert cfg.policies == ("generator0", "generator1", "generator2", "aggregator")
    assert set(trainer.model.peft_config) == set(cfg.policies)
    episodes = rollout(cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    assert {cfg.policy_of(c.role, c.slot) for c in calls} == set(cfg.policies)
    every = _update_grads(trainer, calls, adv)
    assert set(every) == set(cfg.policies)
    for policy in cfg.policies:
        own = [i for i, c in enumerate(calls) if cfg.policy_of(c.role, c.slot) == policy]
        alone = _update_grads(trainer, [calls[i] for i in own], adv[own])
        assert set(alone) == {policy}, policy
        assert every[policy].norm() > 0 and _rel(every[policy], alone[policy]) < 1e-5, policy


def test_per_agent_role_metrics_join_the_agents_adapters(make_cfg, tmp_path):
    """The generator role's metrics under 'agent' are measured on the direct sum of the three voters' adapters:
    its contribution is the norm of theirs joined, its slots sit on disjoint parameters (slot_cos 0,
    slot_amplification 1), and its grad_norm is that of the role's own mean loss (each voter's share 1/3)."""
    trainer = build_trainer(make_cfg("voting", "agent", task="parity", max_grad_norm=1e6), tmp_path)
    cfg = trainer.cfg
    episodes = rollout(cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    got = _update_grads(trainer, calls, adv)
    stats = trainer.update(calls, adv)
    gen = stats["generator"]
    joined = torch.cat([got[f"generator{k}"] for k in range(3)])
    assert gen["grad_contrib_pre"] == pytest.approx(joined.norm().item(), rel=1e-5)
    assert gen["grad_norm"] == pytest.approx(joined.norm().item() / 3, rel=1e-5)  # grpo: equal call counts
    assert gen["slot_cos"] == pytest.approx(0.0, abs=1e-7)
    assert gen["slot_amplification"] == pytest.approx(1.0, rel=1e-5)
    assert gen["proj_share"] == pytest.approx(1.0, rel=1e-6) and "cos_others" not in gen
    assert sum(stats[r]["grad_share"] for r in cfg.role_types) == pytest.approx(1.0)


def test_per_agent_is_refused_where_it_is_ip_and_with_an_intervention(make_cfg):
    from marlflow.core.config import ConfigError

    with pytest.raises(ConfigError, match="no parallel role"):
        make_cfg("eval_opt", "agent")
    with pytest.raises(ConfigError, match="one adapter per agent"):
        dataclasses.replace(make_cfg("voting", "agent"), intervention="norm",
                            intervention_spec={"kind": "same_role_norm"})  # fmt: skip
    with pytest.raises(ValueError, match="give the slot"):
        make_cfg("voting", "agent").policy_of("generator")


def test_sp_measures_each_roles_gradient(make_cfg, tmp_path):
    trainer = build_trainer(make_cfg("voting", "sp", task="parity"), tmp_path)
    trainer.train_step(1)
    m = pd.DataFrame(trainer.metric_rows).set_index(["role", "metric"]).value
    shares = [m[("generator", "grad_share")], m[("aggregator", "grad_share")]]
    assert all(0 < s < 1 for s in shares) and sum(shares) == pytest.approx(1.0)
    assert m[("generator", "grad_norm")] > 0 and m[("aggregator", "grad_norm")] > 0


def test_trainer_rejects_a_mixed_group(make_cfg, tmp_path):
    trainer = build_trainer(make_cfg("single", "sp", task="parity"), tmp_path)
    p1 = Problem(uid="same", task="toy_math", kind="math", prompt="1+1", answer="2")
    p2 = Problem(uid="same", task="toy_code", kind="code", prompt="add 1", answer="")
    eps = [
        Episode(problem=p, rollout=k, calls=[Call("generator0", "generator", [])])
        for k, p in enumerate([p1, p2])
    ]
    with pytest.raises(algos.GroupingError):
        trainer.flatten(eps)


def test_toy_code_step_runs_in_sandbox(make_cfg, tmp_path):
    cfg = make_cfg("single", "sp", task="toy_code", steps=1, max_completion_length=24)
    metrics = run(cfg, tmp_path)
    acc = metrics[(metrics.split == "eval") & (metrics.metric == "accuracy")]
    assert acc.value.between(0, 1).all() and len(acc) == 2


@pytest.mark.slow
@pytest.mark.parametrize("loss_type,mb", [("grpo", 0), ("dapo", 0), ("bnpo", 0), ("grpo", 3), ("dapo", 3)])
def test_skipping_zero_advantage_calls_keeps_trls_whole_batch_loss(make_cfg, tmp_path, loss_type, mb):
    """update() runs only calls with nonzero advantage, per role and slot, in length-sorted chunks of at most
    `micro_batch_size` calls, with shared-prefix forwards; its loss and its FULL gradient vector must equal
    plain TRL's `_compute_loss` on the policy's whole batch (zero-advantage calls included, prefix sharing
    off: TRL's own forward), not just the gradient's norm."""
    cfg = dataclasses.replace(
        make_cfg("voting", "sp", task="parity", loss_type=loss_type, max_grad_norm=1e6), micro_batch_size=mb
    )
    trainer = build_trainer(cfg, tmp_path)
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    adv = adv.clone()
    adv[::3] = 0.0  # as if those calls' groups had no reward variance
    assert (adv != 0).any() and (adv == 0).any()
    trainer.model.set_adapter("shared")
    trainer.model.train()
    tokens = sum(len(c.completion_ids) for c in calls)
    trainer.trl.share_prefix = False  # the reference is TRL's plain forward, not the shared-prefix override
    ref = trainer.trl.loss(trainer.model, trainer.collate(calls, adv, tokens), 0.0).loss
    ref.backward()
    trainer.trl.share_prefix = True
    shared = trainer.policies["shared"]
    ref_grad = torch.cat([p.grad.flatten() for p in shared.params]).clone()
    shared.optimizer.zero_grad(set_to_none=True)
    got = {}
    opt = shared.optimizer
    opt.step = lambda: got.setdefault("g", torch.cat([p.grad.flatten() for p in shared.params]).clone())
    stats = trainer.update(calls, adv)
    del opt.step
    assert stats["all"]["loss"] == pytest.approx(ref.item(), rel=1e-4, abs=1e-6)
    assert stats["all"]["grad_norm"] == pytest.approx(ref_grad.norm().item(), rel=1e-4)
    assert ref_grad.norm() > 0 and _rel(got["g"], ref_grad) < 1e-4  # the whole vector, not only its norm
    assert stats["generator"]["live_frac"] < 1


def test_pieces_sort_each_slot_by_length_and_cap_chunks():
    """Chunks stay inside a slot, hold at most mb calls, are length-sorted and cover every call once."""
    lengths = [9, 3, 7, 1, 5, 8, 2]
    slots = ["g0", "g1", "g0", "g0", "g1", "g0", "agg"]
    calls = [
        Call(role="r", slot=s, messages=[], prompt_ids=[0] * n, completion_ids=[0])
        for n, s in zip(lengths, slots)
    ]
    got = pieces(list(range(7)), calls, 2)
    assert got == [[[3, 2], [5, 0]], [[1, 4]], [[6]]]  # g0 by length 1, 7, 8, 9; then g1; then agg
    flat = [i for slot in got for piece in slot for i in piece]
    assert sorted(flat) == list(range(7))
    assert pieces(list(range(7)), calls, 7)[0] == [[3, 2, 5, 0]]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["model", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefill_generates_what_a_full_prefill_does(make_cfg, tmp_path, temperature, dtype):
    """HFBackend prefills each distinct prompt once and copies its cache to the rows that repeat it; the
    completions (greedy, and sampled from the same RNG state) are those of a full prefill of every row, with
    the training model and with the bf16 generation copy."""
    from marlflow.generation.hf import Sampling

    cfg = dataclasses.replace(make_cfg("voting", "sp", task="parity"), generation_dtype=dtype)
    trainer = build_trainer(cfg, tmp_path)
    backend = trainer.backend
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, *_ = trainer.flatten(episodes)
    prompts = [c.prompt_ids for c in calls]  # 2 problems x 4 rollouts x 3 voters + aggregators
    assert len({tuple(p) for p in prompts}) < len(prompts)
    sampling = Sampling(temperature, 1.0, 12)
    shapes = []  # (rows, positions) of each forward, seen by the embedding layer
    embed = (backend.bf16.model if backend.bf16 else trainer.model).get_input_embeddings()
    hook = embed.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    out, first = {}, {}
    for share in (False, True):
        backend.share_prefill = share
        backend.on_update()  # no stored K/V of these prompts (PrefixKV): the prefill itself is tested
        shapes.clear()
        torch.manual_seed(5)
        out[share] = backend.generate("shared", prompts, sampling)
        first[share] = shapes[:2]
    hook.remove()
    width, unique = max(map(len, prompts)), len({tuple(p) for p in prompts})
    assert first[False] == [(len(prompts), width - 1), (len(prompts), 1)]  # every row prefilled
    assert first[True] == [(unique, width - 1), (len(prompts), 1)]  # distinct prompts once, then last token
    assert out[True] == out[False]


def _piece_tensors(trainer, calls, adv, piece):
    """`collate`'s inputs for `piece` and C = logits_to_keep (its completions' padded width)."""
    inputs = trainer.collate([calls[i] for i in piece], adv[piece], 1)
    return inputs, inputs["completion_ids"].size(1)


@pytest.mark.parametrize("workflow", ["voting", "eval_opt"])
def test_shared_prefix_logps_equal_trls(make_cfg, tmp_path, workflow):
    """A piece's distinct prompts run once (KV cache expanded to the rows): log-probs, entropies and the LoRA
    gradient equal TRL's own forward of every row (`TrlLoss.trl_logps`), for first-stage slots and Eval-Opt's
    later rounds (long shared histories)."""
    shared_slots = 0
    trainer = build_trainer(make_cfg(workflow, "sp", task="parity"), tmp_path)
    with torch.no_grad():  # a trained-looking adapter: a fresh lora_B is zero
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    for slot in dict.fromkeys(c.slot for c in calls):  # every slot: first-stage and long-history prompts
        piece = [i for i, c in enumerate(calls) if c.slot == slot]
        inputs, keep = _piece_tensors(trainer, calls, adv, piece)
        weights = torch.randn(len(piece), keep)
        out = {}
        for name in ("ours", "trl"):
            trainer.model.zero_grad(set_to_none=True)
            if name == "ours":
                shared = trainer.trl.shared_prefix_logps(trainer.model, inputs, entropy=True)
                repeats = len({tuple(calls[i].prompt_ids) for i in piece}) < len(piece)
                assert (shared is not None) == repeats, slot  # shared exactly when a prompt repeats
                if shared is None:  # e.g. aggregators: each rollout's candidates differ
                    break
                logps, ent = shared
            else:
                logps, ent = trainer.trl.trl_logps(trainer.model, inputs, entropy=True)
            ((logps * weights * inputs["completion_mask"]).sum()).backward()
            grad = torch.cat([p.grad.flatten() for p in trainer.policies["shared"].params])
            out[name] = (logps.detach(), ent.detach(), grad)
        if "trl" not in out:
            continue
        m = inputs["completion_mask"].bool()
        assert torch.allclose(out["ours"][0][m], out["trl"][0][m], atol=1e-4), slot
        assert torch.allclose(out["ours"][1][m], out["trl"][1][m], atol=1e-4), slot
        assert torch.allclose(out["ours"][2], out["trl"][2], atol=1e-5, rtol=1e-3), slot
        shared_slots += 1
    assert shared_slots >= 1  # first-stage slots; later rounds carry each rollout's own history


def _update_grads(trainer, calls, adv, **cfg_fields) -> dict[str, torch.Tensor]:
    """Each policy's full flat gradient as update() hands it to AdamW (optimizer step pre-hook), with the
    run config's fields replaced; parameters and AdamW state are put back afterwards."""
    trainer.cfg = dataclasses.replace(trainer.cfg, **cfg_fields)
    saved = {p: [t.detach().clone() for t in st.params] for p, st in trainer.policies.items()}
    grads, hooks = {}, []
    for policy, st in trainer.policies.items():
        opt, params = st.optimizer, st.params

        def record(opt, args, kwargs, policy=policy, params=params):
            grads[policy] = torch.cat([t.grad.detach().flatten().clone() for t in params])

        hooks.append(opt.register_step_pre_hook(record))
    try:
        stats = trainer.update(calls, adv)
        assert stats["all"]["nan_skipped"] == 0
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for p, st in trainer.policies.items():
                for t, v in zip(st.params, saved[p]):
                    t.copy_(v)
        for st in trainer.policies.values():
            st.optimizer.state.clear()
    return grads


@pytest.mark.slow
@pytest.mark.parametrize(
    "workflow,sharing,loss_type",
    [("voting", "sp", "grpo"), ("eval_opt", "ip", "bnpo"), ("orch_workers", "ip", "dapo")],
)
def test_token_budget_chunks_give_the_one_chunk_gradient(make_cfg, tmp_path, workflow, sharing, loss_type):
    """max_chunk_tokens cuts each slot into several chunks of uneven widths; every policy's full gradient
    vector equals the one with each slot in one chunk (max_chunk_tokens 0, micro_batch_size 0)."""
    cfg = make_cfg(workflow, sharing, task="parity", loss_type=loss_type, max_grad_norm=1e6)
    trainer = build_trainer(cfg, tmp_path)
    with torch.no_grad():  # a trained-looking adapter: with lora_B = 0 the A matrices get no gradient
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    live = [i for i in range(len(calls)) if adv[i] != 0]
    widest = max(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    budget = 2 * widest + 1  # at most two calls of the longest kind per chunk
    chunks = [p for role in dict.fromkeys(c.role for c in calls)
              for p in pieces([i for i in live if calls[i].role == role], calls, 0, budget)]  # fmt: skip
    assert max(len(slot) for slot in chunks) >= 2  # several chunks in a slot
    assert max(len(chunk) for slot in chunks for chunk in slot) >= 2  # padded chunks (and shared prompts)
    for slot in chunks:
        for chunk in slot:
            width = max(len(calls[i].prompt_ids) for i in chunk) + max(
                len(calls[i].completion_ids) for i in chunk
            )
            assert len(chunk) == 1 or len(chunk) * width <= budget
    whole = _update_grads(trainer, calls, adv, micro_batch_size=0, max_chunk_tokens=0)
    chunked = _update_grads(trainer, calls, adv, micro_batch_size=0, max_chunk_tokens=budget)
    capped = _update_grads(trainer, calls, adv, micro_batch_size=3, max_chunk_tokens=budget)
    assert set(whole) == set(chunked) == set(capped) == set(cfg.policies)
    for policy, g in whole.items():
        assert g.abs().max() > 0, policy
        tol = 1e-5 * g.abs().max().item()  # float32 sums in another order: ~1e-6 of the largest entry
        torch.testing.assert_close(chunked[policy], g, rtol=1e-4, atol=tol, msg=policy)
        torch.testing.assert_close(capped[policy], g, rtol=1e-4, atol=tol, msg=policy)


def _checkpointing(model, on: bool) -> None:
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


@pytest.mark.slow
@pytest.mark.parametrize("workflow,sharing", [("voting", "sp"), ("eval_opt", "ip")])
def test_gradient_checkpointing_gives_the_same_logps_and_gradients(make_cfg, tmp_path, workflow, sharing):
    """With decoder layers checkpointed, the trainer's log-probs (`TrlLoss.logps`, the loss's forward, which
    shares each repeated prompt's forward when it can), entropies and LoRA gradients equal TRL's plain forward
    without checkpointing, slot by slot; and update()'s full gradient per policy equals the one without it.
    transformers drops a K/V cache inside checkpointed layers, so the shared-prefix path must not run there
    (it gave log-probs up to ~1 nat off, silently)."""
    cfg = make_cfg(workflow, sharing, task="parity", max_grad_norm=1e6)
    trainer = build_trainer(dataclasses.replace(cfg, gradient_checkpointing="on"), tmp_path)
    model = trainer.model
    with torch.no_grad():  # a trained-looking adapter: a fresh lora_B is zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    policy = cfg.policies[0]
    model.set_adapter(policy)
    model.train()
    repeated = 0
    for slot in dict.fromkeys(c.slot for c in calls if cfg.policy_of(c.role) == policy):
        piece = [i for i, c in enumerate(calls) if c.slot == slot]
        repeated += len({tuple(calls[i].prompt_ids) for i in piece}) < len(piece)
        inputs, keep = _piece_tensors(trainer, calls, adv, piece)
        weights = torch.randn(len(piece), keep)
        out = {}
        for name, on in (("plain, no checkpointing", False), ("trainer, checkpointing", True)):
            _checkpointing(model, on)
            assert model.is_gradient_checkpointing == on
            model.zero_grad(set_to_none=True)
            if on:
                logps, ent = trainer.trl.logps(model, inputs, entropy=True)
            else:
                logps, ent = trainer.trl.trl_logps(model, inputs, entropy=True)
            ((logps * weights * inputs["completion_mask"]).sum()).backward()
            grad = torch.cat([p.grad.flatten() for p in trainer.policies[policy].params])
            out[name] = (logps.detach(), ent.detach(), grad)
        (ref_lp, ref_ent, ref_g), (lp, ent, g) = out.values()
        m = inputs["completion_mask"].bool()
        torch.testing.assert_close(lp[m], ref_lp[m], atol=1e-4, rtol=0, msg=f"log-probs, {slot}")
        torch.testing.assert_close(ent[m], ref_ent[m], atol=1e-4, rtol=0, msg=f"entropies, {slot}")
        torch.testing.assert_close(
            g, ref_g, atol=1e-5 * ref_g.abs().max().item(), rtol=1e-3, msg=f"gradient, {slot}"
        )
    assert repeated >= 1  # a slot where the shared-prefix path would run
    grads = {}
    for on in (False, True):
        _checkpointing(model, on)
        grads[on] = _update_grads(trainer, calls, adv)
    assert set(grads[True]) == set(cfg.policies)
    for p, g in grads[False].items():
        assert g.abs().max() > 0, p
        torch.testing.assert_close(grads[True][p], g, atol=1e-5 * g.abs().max().item(), rtol=1e-4, msg=p)


@pytest.mark.slow
def test_gradient_checkpointing_run_generates_as_without_it(make_cfg, tmp_path):
    """gradient_checkpointing 'on' enables non-reentrant checkpointing on the training model; generation
    (eval mode, K/V cache) samples exactly what it samples without checkpointing, even right after a training
    update left the model in training mode; a 2-step run with a KL term (reference forward under no_grad)
    trains and evaluates."""
    from marlflow.generation.hf import Sampling

    cfg = dataclasses.replace(
        make_cfg("voting", "ip", task="parity", beta=0.05),
        gradient_checkpointing="on",
        generation_dtype="model",
    )
    trainer = build_trainer(cfg, tmp_path / "run")
    model = trainer.model
    assert model.is_gradient_checkpointing and trainer.trl.args.gradient_checkpointing
    assert trainer.trl.args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 2)
    prompts = [c.prompt_ids for e in episodes for c in e.calls if c.role == "generator"]
    out = {}
    for on in (True, False):
        _checkpointing(model, on)
        model.train()  # as update() leaves it
        trainer.backend.on_update()
        torch.manual_seed(5)
        out[on] = trainer.backend.generate("generator", prompts, Sampling(1.0, 1.0, 12))
    assert out[True] == out[False]
    # Checkpointing takes effect in the loss's forward: far fewer bytes are kept for backward (distinct storages
    # saved for backward outside the model's parameters; toy model: 1.6 MB against 10.4 MB).
    gen = [c for e in episodes for c in e.calls if c.role == "generator"]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    model.set_adapter("generator")
    saved = {}
    for on in (True, False):
        _checkpointing(model, on)
        model.train()
        kept = {}

        def pack(t, kept=kept):
            if t.untyped_storage().data_ptr() not in params:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inputs = trainer.collate(gen, torch.linspace(-1, 1, len(gen)), 100)
            loss = trainer.trl.loss(model, inputs, 0.0).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        saved[on] = sum(kept.values())
    assert saved[True] < saved[False] / 3, saved
    _checkpointing(model, True)
    metrics = trainer.fit()
    evals = metrics[(metrics.split == "eval") & (metrics.metric == "accuracy") & (metrics.role == "all")]
    assert evals.step.tolist() == [0, 1, 2]
    train = metrics[(metrics.split == "train") & (metrics.role == "all")]
    assert train[train.metric == "nan_skipped"].value.sum() == 0
    assert train[train.metric == "grad_norm"].value.min() > 0
    assert (metrics[metrics.metric == "kl"].value > 0).any()


def test_trl_settings_on_the_toy_model(make_cfg, tmp_path):
    """Checkpointing is off by default at toy scale; the KL term is TRL's bias-corrected one (trl_loss.grpo_args)."""
    trainer = build_trainer(make_cfg("single", "sp", task="parity"), tmp_path)
    assert not trainer.model.is_gradient_checkpointing and not trainer.trl.args.gradient_checkpointing
    assert trainer.trl.args.use_bias_correction_kl is True


@pytest.mark.parametrize("sharing,members", [
    ("sp", {"shared": ["generator", "aggregator"]}),
    ("ip", {"generator": ["generator"], "aggregator": ["aggregator"]}),
    ("agent", {"generator0": ["generator0"], "generator1": ["generator1"], "generator2": ["generator2"],
               "aggregator": ["aggregator"]}),
])  # fmt: skip
def test_per_agent_policy_members_name_slots_only_where_they_have_their_own_adapter(
    make_cfg, sharing, members
):
    cfg = make_cfg("voting", sharing)
    assert cfg.policy_members() == members
    assert cfg.role_policies()["generator"] == [p for p in members if p.startswith(("generator", "shared"))]
