"""Interventions inside real toy training: the KL path against an independent base-model computation, the
gradient hook, a kind defined outside marlflow (tests/interventions_extra/role_gain.py) in a real update, and
SIGKILL + resume equivalence for interventions with state (I6's EMA, cliff_guard's best copy and restore
count)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_interventions import use_role_gain
from test_resume import kill_and_resume
from transformers import AutoModelForCausalLM

from marlflow import interventions as I
from marlflow.cli.train import build_trainer
from marlflow.core.config import ConfigError, RunConfig
from marlflow.tasks import register
from marlflow.tasks.toy import ToyMath
from marlflow.workflows import rollout


@register("parity")
class Parity(ToyMath):
    name = "parity"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


def _with(cfg, name, **spec):
    return dataclasses.replace(cfg, intervention=name, intervention_spec=spec, run_id=f"{cfg.run_id}-{name}")


def _step(trainer, step=1):
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(step), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    return calls, adv


def _logps(model, ids, n):
    logits = model(input_ids=ids).logits[0, -n - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, -n:, None])[:, 0]


def test_kl_matches_an_independent_base_model_computation(make_cfg, tmp_path, toy_model_dir):
    beta = 0.04
    trainer = build_trainer(make_cfg("voting", "ip", task="parity", beta=beta, temperature=1.0), tmp_path)
    calls, adv = _step(trainer)
    stats = trainer.update(calls, adv)  # LoRA B starts at 0: the policy is the base, so KL = 0 ...
    assert stats["aggregator"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats["aggregator"]["live_frac"] == 1.0  # with a KL term every call runs
    c = next(c for c in calls if c.role == "aggregator" and len(c.completion_ids) >= 2)
    ids, n = torch.tensor([c.prompt_ids + c.completion_ids]), len(c.completion_ids)
    base = AutoModelForCausalLM.from_pretrained(toy_model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = _logps(base, ids, n)
        trainer.model.set_adapter("aggregator")
        pol = _logps(trainer.model, ids, n)  # ... but after one step it is not
    expected = I.masked_mean_kl(pol[None], ref[None], torch.ones(1, n))
    assert expected > 1e-6
    inputs = trainer.collate([c], torch.tensor([0.0]), n)  # zero advantage: the loss is beta * KL alone
    inputs["ref_per_token_logps"] = trainer.trl.ref_logps(trainer.model, inputs)
    assert torch.allclose(inputs["ref_per_token_logps"][0], ref, atol=1e-4)
    trainer.model.train()
    loss = trainer.trl.loss(trainer.model, inputs, beta).loss
    assert loss.item() == pytest.approx(beta * expected, rel=1e-3)

    # zero-advantage calls still run with KL, and the KL gradient moves the adapter toward the base
    before = {k: v.clone() for k, v in trainer.model.named_parameters() if ".aggregator." in k}
    stats = trainer.update(calls, torch.zeros_like(adv))
    assert stats["all"]["nan_skipped"] == 0 and stats["aggregator"]["kl"] > 0
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(v, after[k]) for k, v in before.items())


def test_i1_anchors_only_its_role(make_cfg, tmp_path):
    cfg = _with(make_cfg("voting", "ip", task="parity"), "kl", kind="kl_anchor", beta={"aggregator": 0.05})
    trainer = build_trainer(cfg, tmp_path)
    calls, adv = _step(trainer)
    adv = adv.clone()
    adv[::2] = 0.0
    stats = trainer.update(calls, adv)
    assert "kl" in stats["aggregator"] and "kl" not in stats["generator"]
    assert stats["aggregator"]["live_frac"] == 1.0 and stats["generator"]["live_frac"] < 1.0


def test_hook_applies_the_scales_before_clipping(make_cfg, tmp_path):
    """same_role_norm under IP: the generator adapter's applied update is its summed-slot gradient / 3."""
    cfg = _with(make_cfg("voting", "ip", task="parity", max_grad_norm=1e6), "srn", kind="same_role_norm")
    trainer = build_trainer(cfg, tmp_path)
    calls, adv = _step(trainer)
    stats = trainer.update(calls, adv)
    assert stats["generator"]["itv_scale"] == pytest.approx(1 / 3)
    assert stats["aggregator"]["itv_scale"] == 1.0
    assert stats["generator"]["grad_contrib_post"] == pytest.approx(
        stats["generator"]["grad_contrib_pre"] / 3
    )


def test_a_kind_from_outside_marlflow_acts_in_a_real_update(monkeypatch, make_cfg, tmp_path):
    """role_gain (registered through MARLFLOW_INTERVENTIONS, like any kind from outside marlflow) with gain 0
    on the generators: their adapter's applied update is exactly 0 (LoRA B stays at its zero init: no
    gradient, so no AdamW moment and no decay of 0), while the aggregator's adapter moves."""
    use_role_gain(monkeypatch)
    cfg = _with(make_cfg("voting", "ip", task="parity"), "mute", kind="role_gain", gain={"generator": 0.0})
    trainer = build_trainer(cfg, tmp_path)
    assert type(trainer.itv).__name__ == "RoleGain"
    calls, adv = _step(trainer)

    def lora_b(role):
        return [t.detach().clone() for n, t in trainer.model.named_parameters() if f"lora_B.{role}." in n]

    before = {r: lora_b(r) for r in ("generator", "aggregator")}
    assert all(t.abs().sum() == 0 for t in before["generator"])
    stats = trainer.update(calls, adv)
    assert stats["all"]["nan_skipped"] == 0
    assert stats["generator"]["itv_scale"] == 0.0 and stats["aggregator"]["itv_scale"] == 1.0
    assert stats["generator"]["grad_contrib_pre"] > 0 and stats["generator"]["grad_contrib_post"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before["generator"], lora_b("generator")))
    assert any(not torch.equal(a, b) for a, b in zip(before["aggregator"], lora_b("aggregator")))


def test_bad_intervention_definitions_are_refused(make_cfg):
    cfg = make_cfg("voting", "ip")
    cases = [
        (dict(kind="coherence", lam=1.5), "lam is 1.5"),
        (dict(kind="kl_anchor", beta={"judge": 0.1}), "judge is not a role type"),
        (dict(kind="mass_balance", cap=0.5), "needs sharing sp"),
        (dict(kind="coherence", lamda=0.3), "lamda is not a parameter"),
        (dict(kind="magic"), "kind 'magic' is unknown"),
    ]
    for spec, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            _with(cfg, "x", **spec)
    with pytest.raises(ConfigError, match="reserved"):
        _with(cfg, "none", kind="coherence")
    full = _with(cfg, "coh", kind="coherence")
    assert full.intervention_spec == {"kind": "coherence", "lam": 0.3, "window": 128}  # defaults filled in
    with pytest.raises(ConfigError, match="task.val_size >= 1"):  # cliff_guard never selects on test problems
        _with(cfg, "cg", kind="cliff_guard")
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, val_size=4))
    for spec, msg in [
        (dict(kind="cliff_guard", lr_factor=0), "lr_factor is 0"),
        (dict(kind="cliff_guard", max_restores=1.5), "max_restores is 1.5; it must be an integer"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            _with(cfg, "cg", **spec)
    cg = _with(cfg, "cg", kind="cliff_guard")
    assert cg.intervention_spec == {"kind": "cliff_guard", "max_restores": 2, "lr_factor": 0.5, "window": 3,
                                    "alpha": 0.04}  # fmt: skip
    assert RunConfig.from_dict(json.loads(json.dumps(full.to_dict()))) == full


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_with_coherence_state(make_cfg, tmp_path):
    cfg = _with(make_cfg("voting", "sp", task="parity", steps=4, save_every=1, eval_every=2), "coh",
                kind="coherence", lam=0.3, window=2)  # fmt: skip
    _, m = kill_and_resume(cfg, tmp_path)
    scales = m[m.metric == "itv_scale"]
    assert (scales[scales.step >= 2].value < 1).any()  # the EMA exists and acts after the first step


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_with_cliff_guard_state(make_cfg, tmp_path):
    """The drift task (tests/parity_train.py) scores a held-out problem 1 while the workflow says what it said
    at step 0, so validation accuracy (what cliff_guard reads) starts at 1 and falls once training changes
    it. Measured on this config (validation 1.0, 0.5, 0.83, 0.67, 0.5): a restore of step 0 at step 1, before
    the kill inside step 3, whose state (best copy, restore count, learning-rate scale) the resume carries.
    Runs with a source tree edited while they train compute different step-0 keys (base_eval) and differ."""
    cfg = make_cfg("voting", "ip", task="drift", steps=4, save_every=1, eval_every=1)
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, val_size=6))  # cliff_guard reads it
    cfg = _with(cfg, "cg", kind="cliff_guard", max_restores=2, lr_factor=0.5, alpha=0.5)
    # The restore steps were measured with the fp32 sampler; "auto" would pick bf16 on some CPUs.
    cfg = dataclasses.replace(cfg, generation_dtype="model")
    _, m = kill_and_resume(cfg, tmp_path)
    value = m.set_index(["step", "split", "role", "metric"]).value
    val = value.xs(("val", "all", "accuracy"), level=(1, 2, 3))
    restores = value.xs(("train", "all", "guard_restore"), level=(1, 2, 3))
    assert val[0] == 1.0 and (restores == 0).all() and len(restores) >= 1
    first, last = restores.index[0], restores.index[-1]
    assert first <= 2  # a restore before the kill: the resumed run must carry its state
    assert value[(last, "train", "all", "guard_restores")] == len(restores)
    assert value[(last, "train", "all", "guard_lr_scale")] == 0.5 ** len(restores)
    lr = value.xs(("train", "all", "lr"), level=(1, 2, 3))
    assert lr[first] == pytest.approx(1e-2) and lr[first + 1] == pytest.approx(5e-3)  # the schedule is scaled
