"""The hf backend's fast path on CPUs: its own decode loop, grouped-query attention and reuse of K/V.

`marlflow.generation.hf.HFBackend` samples with HF `generate` (the reference, `HFBackend._hf_generate`) or, by
default, with this module's `generate`, which computes the same tokens faster on a CPU:

- `sample`: `generate`'s decode loop and warpers, with finished rows dropped from the batch and K/V written in
  place (`_reserve`), from one prefill per distinct prompt (`prefill_cache`);
- `use_gqa_sdpa`: an attention function registered into transformers that hands grouped K/V heads to SDPA as
  they are, instead of copying them to every query head (the trainer switches its model to it, so the
  training forward uses it too);
- `PrefixKV`: the K/V of earlier calls' sequences, so that a prompt extending one (Eval-Opt's growing
  conversation) runs only its new tokens.

They lean on transformers internals (`cache.layers`, `DynamicLayer`, `batch_select_indices`,
`_attn_implementation`); tests/test_fastgen.py checks, on the toy model, that the fast path samples the
reference's tokens, greedy and sampled from the same seeds, and a transformers upgrade that breaks them shows
there. Measured gain: benchmarks/RESULTS.md "Decode loop, GQA attention, K/V reuse".

The switch: the run config's `fastgen` field (RunConfig.fastgen), handed to `make_backend` / `HFBackend(fast=)`
and `use_gqa_sdpa(model, fast)` when a backend (and the trainer's model) is set up: true uses the fast path (the
default, what `make run` runs), false the reference everywhere (HF `generate`, transformers' own "sdpa"
attention, no stored K/V). Where the tokens come from does not change what they are, so the field is
provenance: left out of config.json at its default, and outside the run's fingerprint.

    matrix.yaml:  run: {fastgen: false}        config.json:  "fastgen": false    # a run on the reference path
"""

from __future__ import annotations

import bisect
import functools

import torch

from marlflow.generation.sampling import Sampling, call_uniforms, distinct_rows

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


def use_gqa_sdpa(model, fast: bool = True) -> bool:
    """Switch a CPU model with grouped-query attention from transformers' "sdpa" to `_sdpa_gqa`; True if switched.

    Measured on the toy model (benchmarks/RESULTS.md "Decode loop, GQA attention, K/V reuse"): the K/V copies
    were over half of a decode step at 600 rows. Only on CPUs: CUDA's SDPA falls back to its math kernel for
    GQA under a mask. False, and nothing switched, with fast=False (RunConfig.fastgen false: the reference)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not fast:
        return False
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


def prefix_store(model) -> PrefixKV | None:
    """A PrefixKV for a backend sampling from `model`, on CPUs only (on a GPU the states would take accelerator
    memory), and None for a model with sliding-window layers (their K/V are not the prefix's alone)."""
    from transformers import DynamicCache

    cpu = next(model.parameters()).device.type == "cpu"
    sliding = any(getattr(x, "is_sliding", False) for x in DynamicCache(config=model.config).layers)
    return PrefixKV(PREFIX_KV_BUDGET) if cpu and not sliding else None


@torch.no_grad()
def generate(model, policy: str, prompts: list[list[int]], ids, mask, sampling: Sampling, eos_ids: set[int],
             pad_id: int, store: PrefixKV | None = None, share_prefill: bool = True,
             keys=None) -> torch.Tensor:  # fmt: skip
    """The fast path of one `HFBackend.generate`: prompts (token ids per call) left-padded into ids / mask
    (B, T) on the model's device -> (B, max_new_tokens) sampled ids, `pad_id` after a row's stop token.

    Prefills each distinct prompt once (`share_prefill`), on top of the K/V `store` holds for the longest
    stored prefix of `policy`'s earlier sequences, then runs `sample`, which adds each finished row's
    sequence to `store`. keys: (B,) per-call keys (`sample`), or None for torch's global RNG."""
    if share_prefill:
        first, inv = distinct_rows(map(tuple, prompts))
    else:
        first, inv = list(range(len(prompts))), list(range(len(prompts)))
    reuse = [store.match(policy, tuple(prompts[i][:-1])) for i in first] if store is not None else None
    cache = prefill_cache(model, ids, mask, first, inv, reuse)
    _reserve(cache, sampling.max_new_tokens)
    keep = None if store is None else (lambda seq, kv: store.add(policy, seq, kv))
    return sample(model, ids, mask, cache, sampling, eos_ids, pad_id, prompts, keep, keys)


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


def warpers(sampling: Sampling):
    """HF `generate`'s warpers for `sampling` as `sample` applies them: temperature, then top-p (none when
    greedy or neutral). Called as warpers(None, logits (B, V)) -> warped scores (B, V)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    out = LogitsProcessorList()
    if sampling.temperature > 0 and sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.temperature > 0 and sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(sampling.top_p))
    return out


_DRAW_ELEMENTS = 2**25  # float64 cumulative probabilities per chunk of `draw` (256 MiB)


def draw(probs: torch.Tensor, u) -> torch.Tensor:
    """Inverse-CDF sampling: probs (B, V) non-negative rows (each summing to about 1), u (B,) uniforms in
    (0, 1) -> (B,) long: per row the first token whose cumulative probability reaches u x the row's total.

    A row picks token v with probability probs[v] / total exactly as far as float64 cumulative sums resolve
    it, so this is the distribution `torch.multinomial` samples, driven by a given number per row instead of
    torch's RNG (RunConfig.sampling_seeds "per_call", with `marlflow.generation.sampling.call_uniforms`). A token of
    probability 0 (cut by top-p) is never picked: u > 0. Computed in row chunks so that the float64 sums of a
    large vocabulary stay within _DRAW_ELEMENTS elements."""
    u = torch.as_tensor(u, dtype=torch.float64, device=probs.device)
    step = max(1, _DRAW_ELEMENTS // max(probs.shape[1], 1))
    out = []
    for i in range(0, probs.shape[0], step):
        cdf = probs[i : i + step].double().cumsum(-1)
        x = (u[i : i + step] * cdf[:, -1]).unsqueeze(1)
        out.append(torch.searchsorted(cdf, x).squeeze(1))
    return torch.cat(out).clamp_(max=probs.shape[1] - 1)


@torch.no_grad()
def sample(model, ids, mask, cache, sampling: Sampling, eos_ids: set[int], pad_id: int, prompts=None,
           keep=None, keys=None) -> torch.Tensor:  # fmt: skip
    """Decode loop of HF `generate` (sampling or greedy, temperature and top-p warpers, stop at `eos_ids`) that
    drops finished rows from the batch. ids / mask (B, T) left-padded prompts; `cache` holds every row's prompt
    but its last token (`prefill_cache`). Returns (B, max_new_tokens) ids, `pad_id` after a row's stop token.

    HF `generate` keeps decoding finished rows until the last row stops (max_new_tokens steps when one row runs
    long); on a CPU each decode step costs in proportion to its rows, so that is mostly waste. The tokens are
    HF's: the same warpers, and one `torch.multinomial` over all B rows per step (finished rows draw the pad
    token), so the RNG stream and each live row's draw are what `generate` would make from the same logits
    (`tests/test_generation.py` checks equality with `generate`).

    keys: (B,) uint64 per-call keys (RunConfig.sampling_seeds "per_call"): then each live row draws its token
    with `draw` from its own number `call_uniforms(key, t)` at completion position t, after the same warpers,
    instead of the batch's `torch.multinomial`; a row's tokens depend on its key and its logits alone, and a
    finished row draws nothing. torch's RNG is not used. Greedy ignores keys.

    `keep(seq, kv)`, if given, receives each row's sequence (its prompt, from `prompts`, and completion, but
    the last sampled token, which never ran) and that sequence's K/V per layer, (H, len(seq), D) each."""
    warp = warpers(sampling)
    n_rows, device = ids.shape[0], ids.device
    stop = torch.tensor(sorted(eos_ids), device=device)
    out = torch.full((n_rows, sampling.max_new_tokens), pad_id, dtype=torch.long, device=device)
    rows = torch.arange(n_rows, device=device)  # the batch rows still decoding
    tok, pos = ids[:, -1:], (mask.sum(-1, keepdim=True) - 1).clamp(min=0)
    full = None  # (B, V) probabilities for the whole-batch draw once rows have stopped
    for t in range(sampling.max_new_tokens):
        logits = model(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True).logits[:, -1].float()  # fmt: skip
        scores = warp(None, logits)
        if sampling.temperature > 0 and keys is not None:
            nxt = draw(torch.softmax(scores, dim=-1), call_uniforms(keys[rows.cpu().numpy()], t))
        elif sampling.temperature > 0:
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


def prefill_cache(model, ids: torch.Tensor, mask: torch.Tensor, first: list[int], inv: list[int], reuse=None):
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
