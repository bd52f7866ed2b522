"""Interleaved A/B of two step-time levers on the toy workflows: sorted chunks of 32 calls, shared prefill.

    python benchmarks/bench_levers.py [--model results/models/toy] [--steps 8] [--task math] [--sharing sp]
        [--quick]   # tiny mode (benchmarks/harness.py): 1 measured step of the first workflow

For each toy workflow two trainers are built from the toy preset's config with the same seed: A as before the
levers (`micro_batch_size` 0, i.e. a slot's calls in one forward-backward chunk, and no shared prefill in
`HFBackend.generate`), B with today's defaults (chunks of at most 32 length-sorted calls, each distinct prompt
prefilled once). They step in lockstep, A then B at every step, on the same problems; step 1 is a warm-up.
Rollouts drift apart as the two policies do (the levers change float rounding only), so the measure is time
per completion (role call) per step, and the ratio B / A is taken per step, then its median. 1 thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from harness import add_cells, parser, setup, toy_cells

from marlflow.cli.train import build_trainer

KEYS = ("time_generate", "time_backward", "step_time")


def _last_step(trainer) -> dict:
    """The workflow's numbers of the step just run, plus `calls`: its role calls (completions)."""
    rows = [r for r in trainer.metric_rows if r["split"] == "train"]
    step = max(r["step"] for r in rows)
    rows = [r for r in rows if r["step"] == step]
    out = {r["metric"]: r["value"] for r in rows if r["role"] == "all"}
    out["calls"] = sum(r["value"] for r in rows if r["role"] != "all" and r["metric"] == "samples")
    return out


def main(argv=None) -> None:
    ap = add_cells(parser(__doc__, reps=8))
    ap.add_argument(
        "--steps",
        dest="reps",
        type=int,
        default=argparse.SUPPRESS,
        help="measured steps per workflow, after 1 warm-up (= --reps; default 8)",
    )
    ap.add_argument("--json", help="write every step's numbers here")
    args = setup(ap.parse_args(argv))
    print(f"{args.reps} steps after 1 warm-up")
    print(
        "| run | A step s | B step s | A calls | B calls | A generate s | B generate s | A fwd+bwd s | "
        "B fwd+bwd s | B / A per call (median, min-max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run_id, cfg in toy_cells(args).items():
            a = build_trainer(dataclasses.replace(cfg, micro_batch_size=0), Path(tmp) / f"{run_id}-a")
            a.backend.share_prefill = False
            b = build_trainer(cfg, Path(tmp) / f"{run_id}-b")
            assert cfg.micro_batch_size == 32 and b.backend.share_prefill
            steps = {"a": [], "b": []}
            for step in range(1, args.reps + 2):
                for name, tr in (("a", a), ("b", b)):
                    t0 = time.perf_counter()
                    tr.train_step(step)
                    m = _last_step(tr)
                    m["wall"] = time.perf_counter() - t0
                    if step > 1:
                        steps[name].append(m)
            ratios = [
                (mb["step_time"] / mb["calls"]) / (ma["step_time"] / ma["calls"])
                for ma, mb in zip(steps["a"], steps["b"])
            ]
            med = {
                n: {k: statistics.median(m[k] for m in v) for k in (*KEYS, "calls")} for n, v in steps.items()
            }
            out[run_id] = {"steps": steps, "ratios": ratios}
            print(
                f"| {run_id} | {med['a']['step_time']:.3f} | {med['b']['step_time']:.3f} | "
                f"{med['a']['calls']:.0f} | {med['b']['calls']:.0f} | {med['a']['time_generate']:.3f} | "
                f"{med['b']['time_generate']:.3f} | {med['a']['time_backward']:.3f} | "
                f"{med['b']['time_backward']:.3f} | {statistics.median(ratios):.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f}) |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
