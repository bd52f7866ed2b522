"""Generation backends: turn chat prompts into completions for one policy at a time.

Workflows hand a backend every call of one stage for one policy at once, so a stage costs one batched
`generate` per policy, never one per episode. Two backends share that interface:

- `HFBackend` (default, CPU and GPU): `model.generate` on the PEFT model with the policy's adapter
  active. It is the reference implementation and what the tests run.
- `VLLMBackend` (optional `gpu` extra, see `marlflow.vllm_backend`): colocated vLLM serving one LoRA per
  policy; imported lazily so that CPU installs never import vllm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    """How to sample: temperature 0 means greedy."""

    temperature: float
    top_p: float
    max_new_tokens: int


class ChatEncoder:
    """Applies the chat template once per distinct prompt (role prompts repeat across the G rollouts)."""

    def __init__(self, tokenizer, max_prompt_length: int):
        self.tok = tokenizer
        self.max_prompt_length = max_prompt_length
        self._cache: dict[str, list[int]] = {}

    def __call__(self, messages: list[dict]) -> list[int]:
        key = repr(messages)
        ids = self._cache.get(key)
        if ids is None:
            # enable_thinking=False turns Qwen3's thinking mode off (paper setup); other templates ignore it.
            out = self.tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, enable_thinking=False
            )
            ids = list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
            # Keep the end of over-long prompts: the instruction and latest turn sit there.
            ids = ids[-self.max_prompt_length :]
            if len(self._cache) > 50_000:
                self._cache.clear()
            self._cache[key] = ids
        return ids


def trim_completion(ids: list[int], eos_ids: set[int]) -> list[int]:
    """Cut a generated sequence after its first end-of-sequence token (kept) and drop padding."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


class HFBackend:
    """`transformers` generation on the training model itself (adapters switched per policy)."""

    def __init__(self, model, tokenizer, policies: tuple[str, ...]):
        self.model = model
        self.tok = tokenizer
        self.policies = policies
        eos = tokenizer.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos)
        self.pad_id = tokenizer.pad_token_id
        self.calls = 0  # generate calls issued, for the benchmark and the batching test

    def on_update(self) -> None:
        """Called after every optimizer step; generation reads the live model, so nothing to sync."""

    @torch.no_grad()
    def generate(self, policy: str, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """prompts: token ids per call -> completion ids per call (ending with eos unless truncated)."""
        if not prompts:
            return []
        self.calls += 1
        self.model.set_adapter(policy)
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        kwargs = dict(
            max_new_tokens=sampling.max_new_tokens, pad_token_id=self.pad_id, eos_token_id=list(self.eos_ids)
        )
        if sampling.temperature > 0:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        finally:
            self.model.train(was_training)
        gen = out[:, width:].tolist()
        return [trim_completion(g, self.eos_ids) for g in gen]


def make_backend(kind: str, model, tokenizer, policies: tuple[str, ...], cfg=None):
    if kind == "hf":
        return HFBackend(model, tokenizer, policies)
    if kind == "vllm":
        from marlflow.vllm_backend import VLLMBackend  # lazy: vllm is an optional GPU extra

        return VLLMBackend(model, tokenizer, policies, cfg)
    raise ValueError(f"unknown generation backend {kind!r}; use 'hf' or 'vllm'")
