"""Evaluation rollouts sampled from the fp32 training model vs its bf16 copy (RunConfig.generation_dtype).

    .venv/bin/python benchmarks/bench_generation_dtype.py [--model results/models/toy] [--reps 3] [--threads 1]
        [--quick]   # tiny mode (benchmarks/harness.py): 1 round of single-sp math

For each toy workflow and task (SP), builds the trainer twice (generation_dtype "model" and "bfloat16") and
times one evaluation rollout (the preset's 200 problems, T = 0.7, one fixed seed) of each, `--reps` rounds
with the two interleaved; prints the median seconds of each, their ratio, and the eval accuracy each got
(a sanity check, not a comparison: the two sample different tokens). On a CPU without native bf16 the bf16
copy is emulated; the script says so first.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import replace
from functools import partial

from harness import WORKFLOWS, eval_rollout, interleaved, parser, setup, toy_configs

from marlflow.cli.train import build_trainer
from marlflow.generation.hf import native_bf16


def main(argv=None) -> None:
    args = setup(parser(__doc__).parse_args(argv))
    print(f"native bf16: {native_bf16()}, median of {args.reps} interleaved rounds")
    configs = toy_configs(args)
    print("| workflow | task | model s | bfloat16 s | bfloat16 / model | accuracy model, bfloat16 |")
    print("|---|---|---|---|---|---|")
    cells = [("single", "math")] if args.quick else [(wf, t) for wf in WORKFLOWS for t in ("math", "code")]
    for wf, task in cells:
        cfg = configs[f"{wf}-sp-toy-{task}-s0"]
        variants = {
            d: partial(
                eval_rollout,
                cfg,
                build_trainer(replace(cfg, generation_dtype=d), tempfile.mkdtemp()),
                cfg.seed + 1,
            )
            for d in ("model", "bfloat16")
        }
        times, acc = interleaved(variants, args.reps)
        m, b = statistics.median(times["model"]), statistics.median(times["bfloat16"])
        print(
            f"| {wf} | {task} | {m:.2f} | {b:.2f} | {b / m:.2f} | {acc['model']:.3f}, {acc['bfloat16']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
