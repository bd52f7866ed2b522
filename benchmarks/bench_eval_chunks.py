"""Evaluation in one batch vs in chunks of problems, on the toy workflows (issue 12, a lever measured and not taken).

    PYTHONPATH=src python benchmarks/bench_eval_chunks.py [--model results/models/toy] [--chunk 64] [--reps 2]

For each run of the toy preset below, the trainer's evaluation rollout (200 problems, eval temperature, 1 thread)
runs once over all problems and once in chunks of `--chunk` problems, alternating, `--reps` times. It prints
the wall seconds and the accuracy of each. Chunking draws other random numbers (another batch shape), so the
accuracies differ between the two by sampling noise.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from marlflow.config import RunConfig
from marlflow.matrix import run_sheet
from marlflow.train import build_trainer
from marlflow.workflows import rollout

RUNS = ("voting-sp-toy-math-s0", "eval_opt-sp-toy-math-s0", "orch_workers-sp-toy-math-s0",
        "single-sp-toy-math-s0", "single-sp-toy-code-s0")  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="results/models/toy")
    ap.add_argument("--matrix", default="matrix.yaml")
    ap.add_argument("--chunk", type=int, default=64, help="problems per chunk")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sheet = run_sheet(args.matrix, preset="toy")
    print("| run | one batch: s (accuracy) | chunks: s (accuracy) |\n|---|---|---|")
    for rid in RUNS:
        cfg = RunConfig.from_dict({**json.loads(sheet.loc[rid, "config"]), "model": args.model})
        with tempfile.TemporaryDirectory() as tmp:
            tr = build_trainer(cfg, Path(tmp))
            probs, res = tr.eval_problems, {"one": [], "chunks": []}
            for _ in range(args.reps):
                for name, size in (("one", len(probs)), ("chunks", args.chunk)):
                    torch.manual_seed(0)
                    ctx = tr._ctx(cfg.grpo.eval_temperature, seed=0)
                    t0 = time.perf_counter()
                    eps = [
                        e
                        for i in range(0, len(probs), size)
                        for e in rollout(cfg, tr.task, probs[i : i + size], ctx, 1)
                    ]
                    res[name].append(
                        f"{time.perf_counter() - t0:.2f} ({sum(e.reward for e in eps) / len(eps):.3f})"
                    )
        print(f"| {rid} | {', '.join(res['one'])} | {', '.join(res['chunks'])} |", flush=True)


if __name__ == "__main__":
    main()
