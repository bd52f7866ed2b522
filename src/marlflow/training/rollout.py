"""The rollout half of a training step: the step's problems -> workflow episodes -> role calls with advantages.

    problems = step_problems(train, seed, step, n)          # a pure function of (seed, step): resume needs no state
    episodes = workflows.rollout(cfg, task, problems, ctx, G)  # G episodes per problem, batched per stage
    batch    = flatten(cfg, episodes)                        # every role call, its episode's reward, GRPO advantage
    rows     = train_rows(cfg, step, gather_stats(batch)[0], stats)  # the step's per-role train metrics

A problem's whole group (its G episodes) is rolled out together and its advantages read only that group
(algos.group_advantages over (problem, slot) groups), so a data-parallel rank can roll out a disjoint share of
the step's problems (marlflow.training.distributed.shard) and flatten its own episodes without any communication; the
update's gradients are summed over the ranks (marlflow.training.update.reduce_policy_grad) and the train metrics read
every rank's small per-call numbers (`gather_stats`), so both mean the same at any rank count. Used by
marlflow.training.trainer; what the metrics mean: marlflow.core.definitions.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from marlflow import workflows
from marlflow.core import algos
from marlflow.generation.sampling import Sampling
from marlflow.store.schema import rows
from marlflow.training import distributed


def step_problems(train_problems: list, seed: int, step: int, n: int) -> list:
    """The step's `n` problems (all when fewer): a pure function of (seed, step), so a resumed run sees the
    same data."""
    rng = random.Random(f"{seed}-{step}")
    return rng.sample(train_problems, min(n, len(train_problems)))


def rollout_seed(seed: int, step: int) -> int:
    """The training rollout's sampling seed: a pure function of (seed, step). Under sampling_seeds "stream"
    only backends with their own RNG (vLLM) read it, HF sampling draws from torch's generator; under
    "per_call" it is the `seed` of every call's key (marlflow.generation.sampling.call_seed, purpose "train")."""
    return seed * 100_003 + step


def context(cfg, task, backend, encoder, temperature: float, timer=None, seed=None, policy_of=None,
            purpose: str = "train"):  # fmt: skip
    """A workflows.Context for one rollout: the run's sampling settings at `temperature`; timer: a dict that
    collects generate / score seconds; policy_of: (role, slot) -> policy override (None: cfg.policy_of); purpose:
    "train", "eval" or "val", part of each call's key under cfg.sampling_seeds "per_call"."""
    g = cfg.grpo
    sampling = Sampling(temperature, g.top_p, g.max_completion_length, seed,
                        per_call=cfg.sampling_seeds == "per_call", purpose=purpose)  # fmt: skip
    return workflows.Context(cfg, task.kind, backend, encoder, sampling, timer, policy_of)


def train_episodes(cfg, task, problems: list, ctx) -> list | None:
    """G = grpo.group_size episodes per problem; None when `ctx.should_stop` stopped the rollout."""
    try:
        return workflows.rollout(cfg, task, problems, ctx, cfg.grpo.group_size)
    except workflows.RolloutStopped:
        return None


@dataclasses.dataclass
class Batch:
    """A step's role calls (N of them, K groups): calls; rewards (N,) each call's episode reward
    (final-outcome credit); advantages (N,); index (N,) each call's (problem, slot) group; std (K,) each
    group's reward standard deviation; episodes: what they came from."""

    episodes: list
    calls: list
    rewards: torch.Tensor
    advantages: torch.Tensor
    index: torch.Tensor
    std: torch.Tensor


def flatten(cfg, episodes: list) -> Batch:
    """Episodes -> their role calls with GRPO advantages within (problem, slot) groups; check_groups() asserts
    that no group mixes problems, roles, tasks, policies or prompts and that each has grpo.group_size calls."""
    calls, keys, rewards = [], [], []
    for e in episodes:
        for c in e.calls:
            calls.append(c)
            keys.append((e.problem.uid, c.slot))
            rewards.append(e.reward)  # final-outcome credit: every role call gets the episode reward
    index, _ = algos.group_ids(keys)
    algos.check_groups(
        index,
        [k[0] for k in keys],
        [c.role for c in calls],
        [e.problem.task for e in episodes for _ in e.calls],
        slots=[c.slot for c in calls],
        rollouts=[e.rollout for e in episodes for _ in e.calls],
        prompt_ids=[c.prompt_ids for c in calls],
        group_size=cfg.grpo.group_size,
        workflow=cfg.workflow,
        policies=[cfg.policy_of(c.role, c.slot) for c in calls],
    )
    r = torch.tensor(rewards, dtype=torch.float32)
    adv, std = algos.group_advantages(r, index)
    return Batch(episodes, calls, r, adv, index, std)


@dataclasses.dataclass(frozen=True)
class CallStat:
    """What the train metrics read of one role call (no token lists): role, group (problem uid, slot), token
    counts, format failure, its episode's reward, its advantage, and whether its group's rewards have no
    variance. A data-parallel rank gathers these, not its calls (`gather_stats`)."""

    role: str
    group: tuple
    prompt_tokens: int
    completion_tokens: int
    format_failure: bool
    reward: float
    advantage: float
    zero_group: bool


def call_stats(batch: Batch) -> list[CallStat]:
    """One CallStat per call of `batch`, in its order."""
    zero = ((batch.std == 0) | torch.isnan(batch.std)).tolist()
    return [
        CallStat(c.role, (e.problem.uid, c.slot), len(c.prompt_ids), len(c.completion_ids), bool(c.format_failure),
                 float(r), float(a), bool(zero[k]))
        for (e, c), r, a, k in zip(((e, c) for e in batch.episodes for c in e.calls), batch.rewards.tolist(),
                                   batch.advantages.tolist(), batch.index.tolist())
    ]  # fmt: skip


def gather_stats(batch: Batch) -> tuple[list[CallStat], list[float]]:
    """The step's CallStats and episode rewards over every rank (marlflow.training.distributed.gather; this rank's for a
    single process), in the 1-rank order: ranks hold contiguous shards of the problem-major episodes."""
    parts = distributed.gather((call_stats(batch), [e.reward for e in batch.episodes]))
    return [s for cs, _ in parts for s in cs], [r for _, rs in parts for r in rs]


def train_rows(cfg, step: int, calls: list[CallStat], stats: dict) -> list[dict]:
    """The step's per-role train metric rows from the CallStats of every call of the step (`gather_stats`):
    samples, tokens, rewards, advantages, the share of groups without reward variance, lengths, format
    failures, and the role's update stats (marlflow.training.update, already summed over ranks)."""
    r = torch.tensor([c.reward for c in calls], dtype=torch.float32)
    adv = torch.tensor([c.advantage for c in calls], dtype=torch.float32)
    out = []
    for role in dict.fromkeys(c.role for c in calls):
        sel = [i for i, c in enumerate(calls) if c.role == role]
        groups = {calls[i].group: calls[i].zero_group for i in sel}  # each of the role's groups once
        lengths = [calls[i].completion_tokens for i in sel]
        values = {
            "samples": len(sel),
            "tokens": sum(lengths),
            "prompt_tokens": sum(
                calls[i].prompt_tokens for i in sel
            ),  # marlflow.pipeline.plan checks its model
            "reward_mean": r[sel].mean().item(),
            "advantage_mean": adv[sel].mean().item(),
            "advantage_std": adv[sel].std().item() if len(sel) > 1 else 0.0,
            "zero_adv_group_frac": torch.tensor(list(groups.values())).float().mean().item(),
            "completion_length": sum(lengths) / len(sel),
            "format_failure_rate": sum(calls[i].format_failure for i in sel) / len(sel),
            **stats.get(role, {}),
        }
        out += rows(cfg.factors, step, "train", role, values)
    return out
