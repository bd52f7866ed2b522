"""What every generation backend shares: how to sample (`Sampling`), where completions stop
(`stop_token_ids`), per-request seeds (`request_seeds`), the rows of a batch that share a prompt
(`distinct_rows`) and the interface a backend offers (`Backend`).

Both backends import this module and neither imports the other's: `marlflow.generation` (the hf backend and
`make_backend`, which picks one) and `marlflow.vllm_backend`. Nothing here imports torch or a model library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
        truncated at sampling.max_new_tokens), sampled from `policy`'s adapter."""
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
