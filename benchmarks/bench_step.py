"""Per-step time split of the toy workflows: generate / score / forward-backward / other.

    python benchmarks/bench_step.py [--model results/models/toy] [--steps 5] [--task math]
        [--quick]   # tiny mode (benchmarks/harness.py): 1 measured step of single

Builds each toy workflow's trainer with the toy preset's settings (from matrix.yaml), runs one warm-up
step and then `--steps` measured training steps, and prints a markdown table of per-step medians plus
the number of generate calls per step. The single-agent workflow is the baseline for the ratio column.
Threads: 1 per job, as in the local profile (two jobs share the 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import pandas as pd
from harness import parser, setup, toy_configs

from marlflow.cli.train import build_trainer
from marlflow.core.config import RunConfig

KEYS = ("time_generate", "time_score", "time_backward", "time_other", "step_time", "generate_calls")


def bench(cfg: RunConfig, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, Path(tmp))
        for step in range(1, steps + 2):
            trainer.train_step(step)
        m = pd.DataFrame(trainer.metric_rows)
    m = m[(m.role == "all") & (m.step > 1)]  # step 1 is the warm-up
    return {k: statistics.median(m[m.metric == k].value) for k in KEYS}


def main(argv=None) -> None:
    ap = parser(__doc__, reps=5)
    ap.add_argument(
        "--steps",
        dest="reps",
        type=int,
        default=argparse.SUPPRESS,
        help="measured steps after 1 warm-up (= --reps; default 5)",
    )
    ap.add_argument("--task", default="math", choices=["math", "code"])
    args = setup(ap.parse_args(argv))
    cells = {k: c for k, c in toy_configs(args).items() if c.task_axis == args.task}
    if args.quick:
        cells = {k: c for k, c in cells.items() if c.workflow == "single"}
    results = {run_id: bench(cfg, args.reps) for run_id, cfg in cells.items()}
    base = next(v["step_time"] for k, v in results.items() if k.startswith("single"))
    print(f"median of {args.reps} steps after 1 warm-up")
    print("| run | generate s | score s | fwd+bwd s | other s | step s | x single | generate calls/step |")
    print("|---|---|---|---|---|---|---|---|")
    for run_id, r in results.items():
        print(
            f"| {run_id} | {r['time_generate']:.3f} | {r['time_score']:.3f} | {r['time_backward']:.3f} | "
            f"{r['time_other']:.3f} | {r['step_time']:.3f} | {r['step_time'] / base:.2f} | "
            f"{r['generate_calls']:.0f} |"
        )


if __name__ == "__main__":
    main()
