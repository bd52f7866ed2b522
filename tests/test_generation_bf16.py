"""The hf backend's bf16 generation copy (RunConfig.generation_dtype): it samples from the policy it is asked
for, follows every update, never runs the fp32 PEFT model, and trains end to end. Forced to "bfloat16" so
that the same code is tested on CPUs with and without native bf16 (where it is slower, not different)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from marlflow.cli.train import build_trainer, run
from marlflow.core.config import ConfigError
from marlflow.generation.hf import BF16Copy, Sampling, resolve_generation_dtype
from marlflow.tasks import register
from marlflow.tasks.toy import ToyMath
from marlflow.workflows import rollout


@register("parity_bf16")
class Parity(ToyMath):
    """Reward = output length is odd: reward variance in every group, so every update moves the adapters."""

    name = "parity_bf16"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


def _perturb_adapters(trainer, seed: int = 0) -> None:
    """Give every policy's lora_B nonzero weights (fresh adapters are exact no-ops), different per policy."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits[:, -1].float()


def test_copy_carries_each_policys_adapter(make_cfg, tmp_path):
    trainer = build_trainer(
        dataclasses.replace(make_cfg("voting", "ip"), generation_dtype="bfloat16"), tmp_path
    )
    _perturb_adapters(trainer)
    copy = trainer.backend.bf16
    assert isinstance(copy, BF16Copy) and next(copy.model.parameters()).dtype == torch.bfloat16
    ids = torch.tensor(
        [trainer.encoder([{"role": "user", "content": f"What is {k}+{k}?"}]) for k in range(4)]
    )
    ref = {}
    for policy in ("generator", "aggregator"):
        trainer.model.set_adapter(policy)
        ref[policy] = _logits(trainer.model, ids)
    assert (ref["generator"] - ref["aggregator"]).abs().max() > 0.5  # the adapters really differ
    for policy, other in (("generator", "aggregator"), ("aggregator", "generator")):
        got = _logits(copy.weights(policy), ids)
        err, gap = (got - ref[policy]).abs().max(), (got - ref[other]).abs().max()
        assert err < 0.1 * gap, (policy, err, gap)  # bf16 rounding, far below the other policy's difference


def test_copy_follows_every_update_and_runs_its_own_forward(make_cfg, tmp_path):
    """After an optimizer step the next generate samples from the new weights (no staleness), and the copy's
    forward is its own: the Trainer wraps the base model's forward in a closure over the fp32 model, which a
    naive deep copy would keep calling."""
    trainer = build_trainer(
        dataclasses.replace(make_cfg("voting", "sp", task="parity_bf16"), generation_dtype="bfloat16"),
        tmp_path,
    )
    _perturb_adapters(trainer)
    copy = trainer.backend.bf16
    lora, target = copy.targets[0]
    model = copy.weights("shared")
    w0 = target.weight.detach().clone()
    expect = (lora.base_layer.weight + lora.get_delta_weight("shared")).to(torch.bfloat16)
    assert torch.equal(w0, expect)
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    assert adv.abs().sum() > 0
    trainer.update(calls, adv)
    copy.weights("shared")
    expect = (lora.base_layer.weight + lora.get_delta_weight("shared")).to(torch.bfloat16)
    assert torch.equal(target.weight, expect) and not torch.equal(target.weight, w0)

    seen = []
    hooks = [m.register_forward_hook(lambda *a: seen.append(1)) for m, _ in copy.targets]
    out = trainer.backend.generate("shared", [calls[0].prompt_ids], Sampling(0.0, 1.0, 4))
    for h in hooks:
        h.remove()
    assert out and out[0] and seen == []  # not one fp32 LoRA layer ran
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.slow
def test_bf16_generation_trains_both_sharings(make_cfg, tmp_path):
    """Rollouts sampled from the bf16 copy train every adapter: with a reward that varies in every group
    (parity_bf16), each policy's LoRA B, zero at the start, is nonzero after 2 steps, under SP and IP."""
    from safetensors.torch import load_file

    for sharing in ("sp", "ip"):
        cfg = make_cfg("orch_workers", sharing, task="parity_bf16")
        cfg = dataclasses.replace(cfg, generation_dtype="bfloat16")
        metrics = run(cfg, tmp_path / sharing)
        acc = metrics[(metrics.split == "eval") & (metrics.metric == "accuracy")]
        assert sorted(acc.step.unique()) == [0, 1, 2]
        last = tmp_path / sharing / "checkpoints" / "step-2" / "adapters"
        for policy in cfg.policies:
            b = [
                t for k, t in load_file(last / policy / "adapter_model.safetensors").items() if "lora_B" in k
            ]
            assert b and any(t.abs().max() > 0 for t in b), (sharing, policy)


def test_generation_dtype_setting(make_cfg, monkeypatch):
    with pytest.raises(ConfigError, match="generation_dtype is 'fp8'; allowed values: auto, model, bfloat16"):
        dataclasses.replace(make_cfg(), generation_dtype="fp8")
    import marlflow.generation.hf as gen

    for native, expect in ((True, "bfloat16"), (False, "model")):
        monkeypatch.setattr(gen, "native_bf16", lambda native=native: native)
        assert resolve_generation_dtype("auto", torch.device("cpu")) == expect
    assert resolve_generation_dtype("auto", torch.device("cuda")) == "model"
    assert resolve_generation_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
