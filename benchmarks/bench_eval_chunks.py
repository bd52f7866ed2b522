"""Evaluation in one batch vs in chunks of problems, on the toy workflows (a lever measured and not taken).

    PYTHONPATH=src python benchmarks/bench_eval_chunks.py [--model results/models/toy] [--chunk 64] [--reps 2]
        [--quick]   # tiny mode (benchmarks/harness.py): 1 round of the first run

For each run of the toy preset below, the trainer's evaluation rollout (200 problems, eval temperature, 1 thread)
runs once over all problems and once in chunks of `--chunk` problems, alternating, `--reps` times. It prints
the wall seconds and the accuracy of each. Chunking draws other random numbers (another batch shape), so the
accuracies differ between the two by sampling noise.
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path

import torch
from harness import interleaved, parser, setup, toy_configs

from marlflow.cli.train import build_trainer
from marlflow.workflows import rollout

RUNS = (
    "voting-sp-toy-math-s0",
    "eval_opt-sp-toy-math-s0",
    "orch_workers-sp-toy-math-s0",
    "single-sp-toy-math-s0",
    "single-sp-toy-code-s0",
)


def _evaluate(cfg, tr, size: int) -> float:
    """The evaluation rollout in chunks of `size` problems (all of them: one batch), seed 0; its accuracy."""
    probs = tr.eval_problems
    torch.manual_seed(0)
    ctx = tr._ctx(cfg.grpo.eval_temperature, seed=0)
    eps = [e for i in range(0, len(probs), size) for e in rollout(cfg, tr.task, probs[i : i + size], ctx, 1)]
    return sum(e.reward for e in eps) / len(eps)


def main(argv=None) -> None:
    ap = parser(__doc__, reps=2)
    ap.add_argument("--chunk", type=int, default=64, help="problems per chunk")
    args = setup(ap.parse_args(argv))
    configs = toy_configs(args)
    print("| run | one batch: s (accuracy) | chunks: s (accuracy) |\n|---|---|---|")
    for rid in RUNS[: 1 if args.quick else None]:
        cfg = configs[rid]
        with tempfile.TemporaryDirectory() as tmp:
            tr = build_trainer(cfg, Path(tmp))
            sizes = {"one": len(tr.eval_problems), "chunks": args.chunk}
            times, acc = interleaved({n: partial(_evaluate, cfg, tr, k) for n, k in sizes.items()}, args.reps)
        cols = [", ".join(f"{t:.2f} ({acc[n]:.3f})" for t in times[n]) for n in sizes]
        print(f"| {rid} | {cols[0]} | {cols[1]} |", flush=True)


if __name__ == "__main__":
    main()
