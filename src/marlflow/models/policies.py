"""A run's trainable policies behind one surface: PEFT LoRA adapters (`adapter: lora`) or one full copy of the
model per policy (`adapter: full`, full fine-tuning at every sharing unit).

Under LoRA the model is a `peft.PeftModel` with one adapter per policy on one frozen base. Under full
fine-tuning it is a `FullPolicies`: one trainable copy of the whole base per policy plus the frozen base as
the reference, with the part of PeftModel's surface the trainer, the hf backend and TRL's loss use
(`set_adapter`, `disable_adapter`, `save_pretrained(selected_adapters=...)`, `config`, ...), so that the
trainer's step reads the same under both. What differs is behind three functions:

    policy_state(model, p)         p's trainable weights by name (LoRA: its adapter; full: its whole model)
    load_policy_state(model, sd, p)  put them back
    attach(cfg, base)              the model a run trains (marlflow.models.loading.attach_adapters calls it)

Full fine-tuning holds, per policy, fp32 weights, gradients and AdamW's two moments of the whole model
(16 bytes per parameter per policy): the planner refuses cells that cannot fit (marlflow.pipeline.plan). vLLM
serves one base with LoRA adapters, so `adapter: full` runs on the hf backend only (RunConfig refuses vllm).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch


class FullPolicies(torch.nn.Module):
    """One trainable copy of `base` per name in `policies` (`policy_models[p]`), and `base` itself, frozen, as
    the reference (`disable_adapter`). Calls go to the active policy's copy (`set_adapter`), as PEFT's go to
    its active adapter. Parameter names hold `.<policy>.` (policy_models.<policy>.model...), which is how the
    trainer finds a policy's parameters, for LoRA adapters too."""

    def __init__(self, base: torch.nn.Module, policies: tuple[str, ...]):
        super().__init__()
        self.reference = base.requires_grad_(False)
        # fp32 copies whatever the base's dtype (bf16 on CUDA): AdamW on bf16 weights loses small updates, and
        # the planner counts 16 bytes per parameter per policy (fp32 weights, gradients, two moments).
        self.policy_models = torch.nn.ModuleDict(
            {p: copy.deepcopy(base).float().requires_grad_(True) for p in policies}
        )
        self.active_adapter = policies[0]
        self._disabled = False

    @property
    def config(self):
        return self.reference.config

    @property
    def generation_config(self):
        return self.reference.generation_config

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(m.is_gradient_checkpointing for m in self.policy_models.values())

    def active(self) -> torch.nn.Module:
        """The model calls go to now: the active policy's copy, or the reference inside `disable_adapter`."""
        return self.reference if self._disabled else self.policy_models[self.active_adapter]

    def for_policy(self, policy: str) -> torch.nn.Module:
        """Policy `policy`'s own model (a plain transformers model), for a backend that samples from it."""
        return self.policy_models[policy]

    def forward(self, *args, **kwargs):
        return self.active()(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.active().generate(*args, **kwargs)

    def set_adapter(self, policy: str) -> None:
        if policy not in self.policy_models:
            raise ValueError(f"no policy {policy!r}; policies: {', '.join(self.policy_models)}")
        self.active_adapter = policy

    @contextlib.contextmanager
    def disable_adapter(self):
        """Calls go to the frozen base inside (the KL term's reference), as with PEFT's adapters disabled."""
        self._disabled = True
        try:
            yield
        finally:
            self._disabled = False

    def set_attn_implementation(self, impl: str) -> None:
        for m in (self.reference, *self.policy_models.values()):
            m.set_attn_implementation(impl)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        for m in self.policy_models.values():
            m.gradient_checkpointing_enable(**kwargs)

    def save_pretrained(self, folder: str | Path, selected_adapters: list[str] | None = None) -> None:
        """Each selected policy's model as a transformers folder `folder/<policy>` (config, weights,
        generation config), loadable with `AutoModelForCausalLM.from_pretrained`."""
        for p in selected_adapters or list(self.policy_models):
            self.policy_models[p].save_pretrained(Path(folder) / p)


def attach(cfg, base: torch.nn.Module):
    """The model run `cfg` trains on `base`: PEFT LoRA adapters (adapter lora) or `FullPolicies` (adapter full),
    one per policy, every policy starting as the base."""
    if cfg.adapter == "full":
        return FullPolicies(base, cfg.policies)
    from peft import LoraConfig, get_peft_model

    g = cfg.grpo
    targets = (
        g.lora_targets if g.lora_targets == "all-linear" else [t.strip() for t in g.lora_targets.split(",")]
    )
    lora = LoraConfig(
        r=g.lora_r, lora_alpha=g.lora_alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    torch.manual_seed(cfg.seed)
    model = get_peft_model(base, lora, adapter_name=cfg.policies[0])
    for p in cfg.policies[1:]:
        model.add_adapter(p, lora)
    return model


def policy_state(model, policy: str) -> dict[str, torch.Tensor]:
    """Policy `policy`'s trainable weights by name, the live tensors (callers copy what they keep)."""
    if isinstance(model, FullPolicies):
        return model.policy_models[policy].state_dict()
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=policy)


def load_policy_state(model, state: dict[str, torch.Tensor], policy: str) -> None:
    """Put `policy_state` weights back into policy `policy` (every tensor must match: strict)."""
    if isinstance(model, FullPolicies):
        model.policy_models[policy].load_state_dict(state, strict=True)
        return
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, state, adapter_name=policy)
