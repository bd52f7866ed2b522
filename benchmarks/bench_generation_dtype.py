"""Evaluation rollouts sampled from the fp32 training model vs its bf16 copy (RunConfig.generation_dtype).

    .venv/bin/python benchmarks/bench_generation_dtype.py [--model results/models/toy] [--reps 3] [--threads 1]

For each toy workflow and task (SP), builds the trainer twice (generation_dtype "model" and "bfloat16") and
times one evaluation rollout (the preset's 200 problems, T = 0.7, one fixed seed) of each, `--reps` rounds
with the two interleaved; prints the median seconds of each, their ratio, and the eval accuracy each got
(a sanity check, not a comparison: the two sample different tokens). On a CPU without native bf16 the bf16
copy is emulated; the script says so first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

import torch
import transformers

from marlflow.config import RunConfig
from marlflow.generation import native_bf16
from marlflow.matrix import run_sheet
from marlflow.train import build_trainer
from marlflow.workflows import rollout

WORKFLOWS = ("single", "eval_opt", "voting", "orch_workers")


def eval_rollout_args(description: str, argv=None) -> argparse.Namespace:
    """--model, --reps, --threads of the evaluation-rollout benchmarks; quiets transformers, sets the threads."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="results/models/toy")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the toy runs use 1)")
    args = ap.parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    return args


def main(argv=None) -> None:
    args = eval_rollout_args(__doc__.split("\n\n")[0], argv)
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"native bf16: {native_bf16()}, threads {args.threads}")  # fmt: skip
    sheet = run_sheet("matrix.yaml", preset="toy")
    print("| workflow | task | model s | bfloat16 s | bfloat16 / model | accuracy model, bfloat16 |")
    print("|---|---|---|---|---|---|")
    for wf in WORKFLOWS:
        for task in ("math", "code"):
            cfg = RunConfig.from_dict({**json.loads(sheet.loc[f"{wf}-sp-toy-{task}-s0", "config"]),
                                       "model": args.model})  # fmt: skip
            trainers = {
                d: build_trainer(dataclasses.replace(cfg, generation_dtype=d), tempfile.mkdtemp())
                for d in ("model", "bfloat16")
            }
            times, acc = {d: [] for d in trainers}, {}
            for _ in range(args.reps):
                for d, tr in trainers.items():
                    seed = cfg.seed + 1
                    with torch.random.fork_rng():
                        torch.manual_seed(seed)
                        t = time.perf_counter()
                        episodes = rollout(cfg, tr.task, tr.eval_problems, tr._ctx(0.7, seed=seed), 1)
                        times[d].append(time.perf_counter() - t)
                    acc[d] = sum(e.reward for e in episodes) / len(episodes)
            m, b = statistics.median(times["model"]), statistics.median(times["bfloat16"])
            print(f"| {wf} | {task} | {m:.2f} | {b:.2f} | {b / m:.2f} | {acc['model']:.3f}, {acc['bfloat16']:.3f} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
