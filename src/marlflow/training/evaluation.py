"""Evaluation of a workflow's current adapters: one function for the trainer and for `marlflow eval`.

    ev = evaluate(cfg, task, backend, encoder, problems, step, base=False)   # test split: rows "eval"
    ev = validate(cfg, task, backend, encoder, problems, step, base=False)   # validation: rows "val"
    ev.metric_rows, ev.sample_rows, ev.outcome_rows, ev.accuracy

One episode per problem at grpo.eval_temperature. Sampling uses its own seeded RNG stream (identical at every
evaluation) and leaves the training RNG untouched, so evaluating never changes what training does next:
torch's CPU and CUDA generators are forked and reseeded (HF sampling), and every vLLM request carries its own
seed (vLLM's sampler has its own RNG, which torch's seed does not reach). The backend's stored K/V are dropped
afterwards, so the next training rollout runs as it would after a resume.

Chunks (RunConfig.eval_chunk_problems > 0): a split's problems are rolled out eval_chunk_problems at a time, in
order, and the trainer checks for a stop before each chunk (`should_stop`), so an evaluation of hours can stop
mid-way and resume at its next chunk (`Partial` holds the finished chunks' episodes; the trainer checkpoints it).
How sampling stays the same whether a run stopped or not: each chunk starts its own RNG stream from a seed
that is a pure function of the evaluation's seed and the chunk's index (`chunk_seed`), so a chunk samples the
same tokens in the uninterrupted run and in the rerun, and no RNG state has to cross a stop. Under
sampling_seeds "per_call" a call's key already names its problem, so every chunk keeps the evaluation's seed.
A chunk is its own batch (and, under "stream", its own stream), so the numbers depend on the chunk size: it is
part of the run's identity. 0 (the default) is one chunk per split, the evaluation as it always ran.

base: the adapters are the untrained ones (B = 0, every policy the base model): every role is routed to the
first policy, which makes the evaluation the same under SP and IP (marlflow.training.base_eval). What the metrics
mean: marlflow.core.definitions; marlflow.training.trainer calls these at step 0 and every grpo.eval_every steps,
marlflow.cli.evaluate for a saved checkpoint on any task.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections import defaultdict

import numpy as np
import torch

from marlflow import workflows
from marlflow.core.definitions import solution_marker
from marlflow.core.workflow_spec import spec_of
from marlflow.store.schema import FACTOR_COLUMNS, rows
from marlflow.tasks.solution_metrics import solution_metrics
from marlflow.training import distributed
from marlflow.training import rollout as ro

EVAL_SEED_OFFSET = 1_000_003
VAL_SEED_OFFSET = 2_000_003  # the validation evaluation's sampling stream: not the test evaluation's


@dataclasses.dataclass
class Evaluation:
    """An evaluation's metric rows (marlflow.store.schema schema), sample rows (SAMPLE_COLUMNS; test only),
    accuracy (mean episode reward) and per-problem outcome rows (OUTCOME_COLUMNS; test and validation)."""

    metric_rows: list[dict]
    sample_rows: list[dict]
    accuracy: float
    outcome_rows: list[dict] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Partial:
    """An evaluation stopped between chunks (RunConfig.eval_chunk_problems): the step it evaluates, the finished
    chunks' episodes per purpose ("eval": test, "val": validation; in the problems' order, every rank's), and the
    wall seconds spent on each so far (time_eval goes on from them). The trainer checkpoints it
    (marlflow.training.checkpoint: eval-partial.pt) and resumes at the next chunk."""

    step: int
    episodes: dict = dataclasses.field(default_factory=dict)
    seconds: dict = dataclasses.field(default_factory=dict)

    def done(self) -> int:
        """Problems evaluated so far, both splits."""
        return sum(len(e) for e in self.episodes.values())

    def outcome_rows(self, cfg, task) -> list[dict]:
        """The finished problems' outcome rows (OUTCOME_COLUMNS), test rows first, as the finished evaluation
        will have them: the test episodes' other candidates (Voting, Orch-Workers) are scored here, as
        `eval_rows` scores them over every episode at the evaluation's end (their `candidates_correct`)."""
        if self.episodes.get("eval"):
            workflows.eval_metrics(cfg.workflow, self.episodes["eval"], task)
        return [r for p in ("eval", "val") for r in outcome_rows(cfg, self.step, p, self.episodes.get(p, []))]


def chunk_seed(cfg, seed: int, k: int) -> int:
    """The sampling seed of chunk k (0-based) of an evaluation seeded with `seed`: `seed` itself for the first
    chunk, and for every chunk under sampling_seeds "per_call" (a call's key already holds its problem's uid);
    under "stream" a seed drawn from (seed, k) by blake2b (in [0, 2**31 - 1): what vLLM's request seeds and
    torch.manual_seed take), so chunk k samples the same tokens whatever came before it."""
    if k == 0 or cfg.sampling_seeds == "per_call":
        return seed
    text = f"{int(seed)}:{int(k)}".encode()
    digest = hashlib.blake2b(text, digest_size=8, person=b"marlflow-chunk").digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def chunked_episodes(cfg, task, backend, encoder, problems: list, seed: int, base: bool, purpose: str = "eval",
                     partial: Partial | None = None, should_stop=None) -> list | None:  # fmt: skip
    """`episodes` of `problems`, cfg.eval_chunk_problems at a time (0: all at once), chunk k sampled from
    `chunk_seed(cfg, seed, k)`. partial: the finished chunks' episodes are read from and added to
    partial.episodes[purpose] (and the seconds to partial.seconds[purpose]), so a resumed evaluation starts at
    its next chunk. should_stop: asked before each chunk when chunks are on (never with one chunk; every rank
    asks at the same chunks: distributed.stop_agreed); yes returns None, the finished chunks kept in `partial`."""
    size = cfg.eval_chunk_problems or max(len(problems), 1)
    done = partial.episodes.setdefault(purpose, []) if partial is not None else []
    stop = should_stop if cfg.eval_chunk_problems else None
    while len(done) < len(problems):
        if stop is not None and stop():
            return None
        t0, start = time.perf_counter(), len(done)
        done += episodes(cfg, task, backend, encoder, problems[start : start + size],
                         chunk_seed(cfg, seed, start // size), base, purpose)  # fmt: skip
        if partial is not None:
            partial.seconds[purpose] = partial.seconds.get(purpose, 0.0) + time.perf_counter() - t0
    return list(done)


def accuracy(episodes: list) -> dict:
    """accuracy (mean episode reward), its binomial standard error and n_eval, as an evaluation logs them."""
    n = len(episodes)
    acc = sum(e.reward for e in episodes) / n
    return {"accuracy": acc, "accuracy_se": math.sqrt(acc * (1 - acc) / n), "n_eval": n}


def episodes(
    cfg, task, backend, encoder, problems: list, seed: int, base: bool, purpose: str = "eval"
) -> list:
    """One episode per problem at eval_temperature from a forked RNG stream seeded with `seed` (the caller's
    RNG untouched); the backend's stored K/V dropped afterwards. base: see the module docstring. purpose:
    "eval" (test) or "val", part of each call's key under sampling_seeds "per_call" (marlflow.generation.sampling.call_seed;
    like the seeded stream, the same keys at every evaluation, so evaluations differ by their weights alone).

    Data parallel (marlflow.training.distributed): each rank rolls out its shard of `problems` and every rank gets all
    the episodes back in the problems' order, so the rows computed from them are the 1-rank rows (a single
    process: its own rollout of every problem)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    route = (lambda role, slot, first=cfg.policies[0]: first) if base else None
    mine = distributed.shard(problems, distributed.rank(), distributed.world())
    out = []
    if mine:  # fewer problems than ranks leaves a rank none: it only takes part in the gather
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)  # also seeds every CUDA device
            ctx = ro.context(cfg, task, backend, encoder, cfg.grpo.eval_temperature, seed=seed, policy_of=route,
                             purpose=purpose)  # fmt: skip
            out = workflows.rollout(cfg, task, mine, ctx, 1)
        backend.forget_states()
    return distributed.gather_shards(out)


@torch.no_grad()
def evaluate(cfg, task, backend, encoder, problems: list, step: int, base: bool = False,
             partial: Partial | None = None, should_stop=None) -> Evaluation | None:  # fmt: skip
    """Workflow accuracy on the test problems (split "eval"), one episode each: `eval_rows` of
    `chunked_episodes`; None when `should_stop` stopped it between chunks (see chunked_episodes)."""
    t0 = time.perf_counter()
    eps = chunked_episodes(cfg, task, backend, encoder, problems, cfg.seed + EVAL_SEED_OFFSET, base, "eval",
                           partial, should_stop)  # fmt: skip
    if eps is None:
        return None
    if partial is not None:  # time_eval: this evaluation's own seconds, over every attempt
        t0 = time.perf_counter() - partial.seconds.get("eval", 0.0)
    return eval_rows(cfg, task, step, eps, t0, encoder.tok)


def eval_rows(cfg, task, step: int, eps: list, t0: float, tok) -> Evaluation:
    """The test evaluation's rows from its episodes (in the problems' order; a data-parallel run gathers them
    first): role "all" accuracy, its SE and n, the two fixed halves' accuracies, the workflow's and the task's
    own metrics, time_eval (seconds since t0); per role format failures, completion lengths,
    truncated_share, calls (and the supervisor's solution_marker_share); the first cfg.samples_per_eval
    episodes in full as sample rows (prompts decoded with `tok`)."""
    values = accuracy(eps)
    # Two fixed halves of the eval set (episodes follow the problems' order): the analysis picks the peak step
    # on one half and reads it on the other (peak_confirmed), so the max over evals is not rewarded.
    half_a, half_b = [e.reward for e in eps[0::2]], [e.reward for e in eps[1::2]]
    values.update(
        accuracy_a=sum(half_a) / len(half_a),
        n_eval_a=len(half_a),
        accuracy_b=sum(half_b) / len(half_b) if half_b else math.nan,
        n_eval_b=len(half_b),
    )
    values.update(workflows.eval_metrics(cfg.workflow, eps, task))
    # the task's own metrics of its solvers' outputs (toy tasks: careless_share)
    solved = [c.text for e in eps for c in e.calls if c.role in spec_of(cfg.workflow).solver_roles]
    values.update(solution_metrics(task, solved))
    values["time_eval"] = time.perf_counter() - t0  # rollout and scoring of the eval set, wall seconds
    metric_rows = rows(cfg.factors, step, "eval", "all", values) + _role_rows(cfg, step, eps)
    return Evaluation(metric_rows, sample_rows(cfg, step, eps, tok), values["accuracy"],
                      outcome_rows(cfg, step, "eval", eps))  # fmt: skip


@torch.no_grad()
def validate(cfg, task, backend, encoder, problems: list, step: int, base: bool = False,
             partial: Partial | None = None, should_stop=None) -> Evaluation | None:  # fmt: skip
    """Workflow accuracy on the validation problems (split "val", role "all": accuracy, accuracy_se, n_eval,
    time_eval); what cliff_guard reads. Its own seed, so its samples are not the test's. Chunks, partial and
    should_stop as in `evaluate`."""
    t0 = time.perf_counter()
    eps = chunked_episodes(cfg, task, backend, encoder, problems, cfg.seed + VAL_SEED_OFFSET, base, "val",
                           partial, should_stop)  # fmt: skip
    if eps is None:
        return None
    if partial is not None:
        t0 = time.perf_counter() - partial.seconds.get("val", 0.0)
    values = {**accuracy(eps), "time_eval": time.perf_counter() - t0}
    return Evaluation(rows(cfg.factors, step, "val", "all", values), [], values["accuracy"],
                      outcome_rows(cfg, step, "val", eps))  # fmt: skip


def outcome_rows(cfg, step: int, split: str, eps: list) -> list[dict]:
    """One row per episode (= per problem: evaluations run one episode each) in OUTCOME_COLUMNS
    (marlflow.store.schema, which says what each column is); split "eval" (test) or "val"."""
    factors = {"build": 0, **cfg.factors}
    budget = cfg.grpo.max_completion_length
    out = []
    for e in eps:
        lengths = [len(c.completion_ids) for c in e.calls]
        truncated = sum(n >= budget for n in lengths)
        cands = e.info.get("candidate_scores", [])
        out.append({**{c: factors[c] for c in FACTOR_COLUMNS}, "step": int(step), "split": split,
                    "uid": str(e.problem.uid), "reward": float(e.reward), "correct": e.reward >= 1.0,
                    "completion_tokens": sum(lengths), "calls": len(e.calls), "truncated_calls": truncated,
                    "format_failures": sum(c.format_failure for c in e.calls),
                    "finish_reason": "length" if truncated else "stop", "candidates": len(cands),
                    "candidates_correct": sum(x >= 1.0 for x in cands),
                    "rounds": int(e.info.get("rounds", 1))})  # fmt: skip
    return out


def _role_rows(cfg, step: int, eps: list) -> list[dict]:
    by_role = defaultdict(list)
    for e in eps:
        for c in e.calls:
            by_role[c.role].append(c)
    supervisor = (spec_of(cfg.workflow).supervisor or (None,))[0]
    out = []
    for role, cs in by_role.items():
        lengths = [len(c.completion_ids) for c in cs]
        values = {
            "format_failure_rate": sum(c.format_failure for c in cs) / len(cs),
            "completion_length": sum(lengths) / len(cs),
            # sample sd over calls: the capture length test's standard error (analysis.failures)
            "completion_length_sd": float(np.std(lengths, ddof=1)) if len(cs) > 1 else 0.0,
            # calls cut off at the completion budget: `marlflow eval` warns above 5% (an answer cut off
            # is scored wrong, so a budget too small for the task reads as "no transfer")
            "truncated_share": sum(n >= cfg.grpo.max_completion_length for n in lengths) / len(cs),
            "calls": len(cs),
        }
        if role == supervisor:  # capture evidence over every eval call, not the logged sample episodes
            values["solution_marker_share"] = sum(solution_marker(cfg.workflow, c.text) for c in cs) / len(cs)
        out += rows(cfg.factors, step, "eval", role, values)
    return out


def sample_rows(cfg, step: int, eps: list, tok) -> list[dict]:
    """The first cfg.samples_per_eval episodes, one row per role call (marlflow.store.schema.SAMPLE_COLUMNS)."""
    return [
        {**cfg.factors, "step": step, "episode": k, "uid": e.problem.uid, "slot": c.slot, "role": c.role,
         "prompt": tok.decode(c.prompt_ids), "output": c.text, "reward": e.reward,
         "format_failure": c.format_failure}
        for k, e in enumerate(eps[: cfg.samples_per_eval])
        for c in e.calls
    ]  # fmt: skip
