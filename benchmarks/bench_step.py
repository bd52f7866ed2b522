"""Per-step time split of the toy workflows: generate / score / forward-backward / other.

    python benchmarks/bench_step.py [--model results/models/toy] [--steps 5] [--task toy_math]

Builds each toy workflow's trainer with the toy preset's settings (from matrix.yaml), runs one warm-up
step and then `--steps` measured training steps, and prints a markdown table of per-step medians plus
the number of generate calls per step. The single-agent workflow is the baseline for the ratio column.
Threads: 1 per job, as in the local profile (two jobs share the 2 cores).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

import pandas as pd
import torch

from marlflow.config import RunConfig
from marlflow.matrix import run_sheet
from marlflow.train import build_trainer

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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="results/models/toy")
    ap.add_argument("--matrix", default="matrix.yaml")
    ap.add_argument("--task", default="math", choices=["math", "code"])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    sheet = run_sheet(args.matrix, preset="toy")
    sheet = sheet[sheet.task == args.task]
    results = {}
    for run_id, row in sheet.iterrows():
        cfg = RunConfig.from_dict({**json.loads(row.config), "model": args.model})
        results[run_id] = bench(cfg, args.steps)
    base = next(v["step_time"] for k, v in results.items() if k.startswith("single"))
    print(f"machine: {platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"median of {args.steps} steps after 1 warm-up")  # fmt: skip
    print("| run | generate s | score s | fwd+bwd s | other s | step s | x single | generate calls/step |")
    print("|---|---|---|---|---|---|---|---|")
    for run_id, r in results.items():
        print(f"| {run_id} | {r['time_generate']:.3f} | {r['time_score']:.3f} | {r['time_backward']:.3f} | "
              f"{r['time_other']:.3f} | {r['step_time']:.3f} | {r['step_time'] / base:.2f} | "
              f"{r['generate_calls']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
