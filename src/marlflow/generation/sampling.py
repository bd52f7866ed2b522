"""What every generation backend shares: how to sample (`Sampling`), where completions stop
(`stop_token_ids`), per-request seeds (`request_seeds`), per-call keys and their random numbers (`call_seed`,
`call_uniforms`: RunConfig.sampling_seeds "per_call"), the rows of a batch that share a prompt
(`distinct_rows`) and the interface a backend offers (`Backend`).

Both backends import this module and neither imports the other's: `marlflow.generation.hf` (the hf backend and
`make_backend`, which picks one) and `marlflow.generation.vllm`. Nothing here imports torch or a model library.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class Sampling:
    """How to sample: temperature 0 means greedy."""

    temperature: float
    top_p: float
    max_new_tokens: int
    # Base seed of this rollout's sampling (evaluation sets one). HF sampling draws from torch's global RNG,
    # which the trainer seeds and checkpoints; vLLM keeps its own RNG, so it seeds each request from this.
    seed: int | None = None
    # RunConfig.sampling_seeds "per_call": every call samples from its own key (`call_seed`), which the
    # workflow context hands the backend as `seeds`; False: the backend's stream (see `Backend.generate`).
    per_call: bool = False
    # What the rollout is for, part of each call's key: "train" (seed: marlflow.training.rollout.rollout_seed of the
    # step), "eval" or "val" (marlflow.training.evaluation), so the three never share keys even where their seeds do.
    purpose: str = "train"


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


KEY_BITS = 63  # call keys are non-negative int64: torch.Generator and vLLM's SamplingParams(seed=) take them


def call_seed(seed: int, purpose: str, uid: str, slot: str, rollout: int) -> int:
    """The sampling key of one role call under RunConfig.sampling_seeds "per_call": an int in [0, 2**63).

    seed: the rollout's seed (`Sampling.seed`: marlflow.training.rollout.rollout_seed(run seed, step) for a training
    step, the run seed plus marlflow.training.evaluation's offset for an evaluation); purpose: "train" / "eval" / "val";
    uid: the problem's uid; slot: the call's slot (generator0, evaluator1, ...); rollout: the episode's index
    among its problem's G rollouts (workflows.Episode.rollout; 0 in evaluations).

    A pure function of its arguments: blake2b of their canonical JSON, not Python's hash() (salted per
    process), so every process, rank, machine and Python version gets the same key, and a call's key does not
    depend on which other calls share its batch or their order."""
    text = json.dumps([int(seed), str(purpose), str(uid), str(slot), int(rollout)], separators=(",", ":"))
    digest = hashlib.blake2b(text.encode(), digest_size=8, person=b"marlflow-call").digest()
    return int.from_bytes(digest, "little") >> (64 - KEY_BITS)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def call_uniforms(keys, t: int) -> np.ndarray:
    """keys (B,) call keys (`call_seed`), t the completion position being sampled -> (B,) float64 uniforms in
    (0, 1), one per call: output t of SplitMix64 seeded with the key (Steele, Lea & Flood 2014; what seeds
    java.util.SplittableRandom and xoshiro): its top 52 bits k as (k + 1/2) / 2**52, exact in float64, so 0 and
    1 never occur.

    Counter-based: a call's number at position t is a pure function of (key, t), so a call draws the same
    numbers whatever rows share its batch or stop before it, and a stopped call consumes none. numpy uint64
    arithmetic wraps modulo 2**64, which SplitMix64 needs."""
    z = np.asarray(keys, dtype=np.uint64) + np.array([t + 1], dtype=np.uint64) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(12)).astype(np.float64) + 0.5) / 2.0**52


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


class Backend(Protocol):
    """What the trainer and the workflows call on a generation backend (`generation.HFBackend`,
    `vllm_backend.VLLMBackend`); `generation.make_backend` builds one from RunConfig.backend."""

    calls: int  # generate calls issued so far
    last_logps: (
        list[list[float]] | None
    )  # per call, the sampled tokens' log-probs of the last generate, or None

    def generate(
        self, policy: str, prompts: list[list[int]], sampling: Sampling, seeds: list[int] | None = None
    ) -> list[list[int]]:
        """Prompt token ids per call -> the sampled completion ids per call (ending with a stop token unless
        truncated at sampling.max_new_tokens), sampled from `policy`'s adapter.

        seeds: one per call or None. With sampling.per_call they are the calls' keys (`call_seed`), and a
        call's tokens are a pure function of its key and its logits; otherwise the hf backend ignores them
        (it draws from torch's global RNG) and vLLM seeds each request with them (`request_seeds`)."""
        ...

    def before_update(self) -> None:
        """Called at the start of every update (a backend holding accelerator memory may release it)."""
        ...

    def on_update(self) -> None:
        """Called after every weight change (optimizer step, restore)."""
        ...

    def forget_states(self) -> None:
        """Drop anything kept from earlier calls (after an evaluation)."""
        ...

    def close(self) -> None:
        """Release what the backend owns."""
        ...
