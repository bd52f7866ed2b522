"""Workflows: role graphs that turn a batch of problems into episodes of role calls.

A workflow is a function `run(episodes, ctx)` that advances *all* episodes of a step together, stage by
stage. Each stage collects the role calls it needs and hands them to `ctx.generate`, which issues one
batched generate per policy (SP: one; IP: one per role type present in the stage). Workflows do not
know which backend, policy routing or model runs underneath.

    episodes = rollout(cfg, task, problems, backend, encoder, sampling, group_size=G)
    episodes[i].final       # the text that is scored
    episodes[i].calls       # every role call: slot, role, prompt ids, completion ids, text

Unparseable role outputs (no verdict, no pick, no strategies) take the fallback documented in each
workflow and set `Call.format_failure`, which the trainer reports per role.

What the rest of marlflow knows about a workflow (roles, slots, calls per episode, ...) is its module's
`SPEC`, a `marlflow.core.workflow_spec.WorkflowSpec`; `spec_of(name)` finds it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from marlflow.core.workflow_spec import spec_of
from marlflow.generation.sampling import Sampling, call_seed, request_seeds
from marlflow.tasks import Problem


@dataclass
class Call:
    """One role call in one episode. `slot` names the call's position (generator0, evaluator1, worker2):
    GRPO groups are (problem, slot) across the G rollouts of a problem."""

    slot: str
    role: str
    messages: list[dict]
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    text: str = ""
    format_failure: bool = False
    # Log-probabilities of the sampled completion tokens as the rollout engine computed them (vLLM); None
    # when the backend does not report them. The trainer compares them with its own (`logp_gap`).
    rollout_logps: list[float] | None = None


@dataclass
class Episode:
    problem: Problem
    rollout: int  # index among the G rollouts of this problem
    calls: list[Call] = field(default_factory=list)
    final: str = ""
    reward: float = 0.0
    info: dict = field(default_factory=dict)


class RolloutStopped(Exception):
    """`Context.should_stop` answered yes before a stage: the rollout was abandoned between two stages."""


class Context:
    """What a workflow may use: the task kind, run settings and a batched `generate`."""

    def __init__(self, cfg, kind: str, backend, encoder, sampling: Sampling, timer: dict | None = None,
                 policy_of=None):  # fmt: skip
        self.cfg = cfg
        # (role, slot) -> policy whose adapter answers it; the step-0 evaluation routes every call to one policy
        self.policy_of = policy_of or cfg.policy_of
        self.kind = kind
        self.backend = backend
        self.encoder = encoder
        self.sampling = sampling
        self.timer = timer if timer is not None else defaultdict(float)
        self.stage = 0  # backend calls so far in this rollout: each gets its own request seeds (stream)
        # () -> bool, asked before each stage; True raises RolloutStopped. The trainer sets it for training
        # rollouts (marlflow.training.preempt: a stop requested during a rollout abandons the step at its next stage).
        self.should_stop = None

    def generate(self, pending: list[tuple[Episode, Call]]) -> None:
        """Fill in every call's completion, one backend call per policy.

        The seeds handed to the backend: under sampling.per_call (RunConfig.sampling_seeds "per_call") each
        call's key, `call_seed(sampling.seed, sampling.purpose, problem uid, slot, rollout index)`, so its
        tokens do not depend on the batch it shares; otherwise (stream) `request_seeds` of the rollout's seed
        and this backend call's index, which only vLLM reads."""
        if self.should_stop is not None and self.should_stop():
            raise RolloutStopped(f"stop requested before stage {self.stage} of the rollout")
        t0 = time.perf_counter()
        by_policy: dict[str, list[tuple[Episode, Call]]] = defaultdict(list)
        for episode, call in pending:
            episode.calls.append(call)
            call.prompt_ids = self.encoder(call.messages)
            by_policy[self.policy_of(call.role, call.slot)].append((episode, call))
        seed, purpose = self.sampling.seed, self.sampling.purpose
        if self.sampling.per_call and seed is None:
            raise ValueError("per-call sampling needs the rollout's seed (Sampling.seed): set it, as "
                             "marlflow.training.rollout.context does for training and evaluation rollouts")  # fmt: skip
        for policy, pairs in by_policy.items():
            calls = [c for _, c in pairs]
            if self.sampling.per_call:
                seeds = [call_seed(seed, purpose, e.problem.uid, c.slot, e.rollout) for e, c in pairs]
            else:
                seeds = None if seed is None else request_seeds(seed, self.stage, len(calls))
            self.stage += 1
            outs = self.backend.generate(policy, [c.prompt_ids for c in calls], self.sampling, seeds)
            logps = self.backend.last_logps or [None] * len(calls)
            texts = self.encoder.tok.batch_decode(outs, skip_special_tokens=True)
            for call, ids, text, lp in zip(calls, outs, texts, logps):
                call.completion_ids, call.text, call.rollout_logps = ids, text.strip(), lp
        self.timer["generate"] += time.perf_counter() - t0


def eval_metrics(workflow: str, episodes: list[Episode], task) -> dict[str, float]:
    """The workflow's own eval metrics (role `all`), from its spec's `eval_metrics(episodes, task)` if it
    has one: what only that role graph can say (candidate accuracy, rounds used)."""
    fn = spec_of(workflow).eval_metrics
    return fn(episodes, task) if fn else {}


def candidate_metrics(episodes: list[Episode], task, key: str) -> dict[str, float]:
    """Voting / Orch-Workers: `any_correct` (an episode has at least one correct candidate) and `key` (mean
    score of every candidate). The picked Voting candidate is the episode's final, already scored: reused.
    Each episode's candidate scores are left in its info["candidate_scores"]."""
    finals = {(id(e), e.final): e.reward for e in episodes}
    todo = [(e, c) for e in episodes for c in e.info.get("candidates", []) if (id(e), c) not in finals]
    fresh = iter(task.score([e.problem for e, _ in todo], [c for _, c in todo]) if todo else [])
    per_ep = [[finals[(id(e), c)] if (id(e), c) in finals else next(fresh) for c in e.info.get("candidates", [])]
              for e in episodes]  # fmt: skip
    for e, s in zip(episodes, per_ep):  # kept for the evaluation's per-problem outcomes (candidates_correct)
        e.info["candidate_scores"] = s
    scores = [s for ep in per_ep for s in ep]
    return {
        "any_correct": sum(bool(s) and max(s) > 0 for s in per_ep) / len(episodes),
        key: float(np.mean(scores)) if scores else 0.0,
    }


def rollout(cfg, task, problems: list[Problem], ctx: Context, group_size: int) -> list[Episode]:
    """Run `group_size` episodes of the workflow per problem, score them, and return them.

    Episodes are ordered problem-major: episode i belongs to problems[i // group_size]."""
    episodes = [Episode(problem=p, rollout=g) for p in problems for g in range(group_size)]
    spec_of(cfg.workflow).run(episodes, ctx)
    t0 = time.perf_counter()
    rewards = task.score([e.problem for e in episodes], [e.final for e in episodes])
    for e, r in zip(episodes, rewards):
        e.reward = float(r)
    ctx.timer["score"] += time.perf_counter() - t0
    return episodes
