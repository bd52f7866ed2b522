"""Memory and time planner: will a run fit on a GPU, and how long will it take?

The `marlflow plan` command (also `python -m marlflow plan`); its library is `marlflow.pipeline.plan`.

    marlflow plan --preset paper              # the summary, then one short row per run (fits 100 columns)
    marlflow plan --preset paper --details    # every column: tokens per call, memory by part, ...
    marlflow plan --preset paper --format csv # every column, as CSV

Output cut short by its reader (`marlflow plan ... | head`) ends quietly, exit 0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import textwrap

from marlflow.pipeline.plan import (
    COLUMNS,
    GPUS,
    JOB_LIMIT_MIN,
    PlanError,
    choose_gpus,
    plan_sheet,
    resources,
    summary,
    table_rows,
)

# The short table's columns (of pipeline.plan.COLUMNS): whether each run fits, and its time.
SHORT = ["run_id", "peak GB", "fits (>=10% spare)", "step s", "run h", "GPU-h"]


def _print_table(columns: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def main(argv=None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader stopped reading (`| head`): no traceback, and none at exit either
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="marlflow plan", description=__doc__.splitlines()[0])
    ap.add_argument("--matrix", default="matrix.yaml", help="matrix file (default: matrix.yaml)")
    ap.add_argument("--preset", help="preset to plan (default: the file's default_preset)")
    ap.add_argument("--gpu", default="h100-80gb", choices=list(GPUS), help="GPU kind (default: h100-80gb)")
    ap.add_argument("--n-gpus", type=int, default=1, help="data-parallel GPUs per run (default 1)")
    ap.add_argument("--format", choices=["md", "csv"], default="md",
                    help="table format (default md); csv has every column")  # fmt: skip
    ap.add_argument("--details", action="store_true",
                    help="every column in the md table: tokens per call, memory by part, chunk sizes")  # fmt: skip
    ap.add_argument("--resources", action="store_true",
                    help="print per-scale runtime (minutes: the longest run at 100%% of the cap, at most "
                         "--job-limit-min), submissions needed and peak GB as YAML, for "
                         "profiles/slurm/scale_resources.yaml")  # fmt: skip
    ap.add_argument(
        "--job-limit-min",
        type=int,
        default=JOB_LIMIT_MIN,
        help=f"with --resources: the cluster's job time limit in minutes (default {JOB_LIMIT_MIN})",
    )
    ap.add_argument("--max-gpus", type=int, default=1,
                    help="with --resources: also choose GPUs per run for each scale (powers of two up to this; "
                         "choose_gpus) and print gpu: N with the runtime at N")  # fmt: skip
    ap.add_argument("--target-hours", type=float, default=48.0,
                    help="with --max-gpus: the longest run's wall time to aim for (default 48)")  # fmt: skip
    args = ap.parse_args(argv)
    from marlflow.pipeline.matrix import MatrixError

    try:
        plans = plan_sheet(args.matrix, args.preset, args.gpu, args.n_gpus)
    except (MatrixError, PlanError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.resources:
        if args.job_limit_min < 1 or args.max_gpus < 1:
            print("error: --job-limit-min and --max-gpus must be >= 1", file=sys.stderr)
            return 2
        chosen = {}
        if args.max_gpus > 1:
            counts = [2**k for k in range(int(math.log2(args.max_gpus)) + 1)]
            by_n = {1: plans, **{n: plan_sheet(args.matrix, args.preset, args.gpu, n) for n in counts[1:]}}
            chosen = choose_gpus(by_n, args.target_hours)
            plans = [p for n in counts for p in by_n[n] if chosen.get(p.scale, {}).get("gpu", 1) == n]
        for scale, r in resources(plans, args.job_limit_min).items():
            r = {
                **(
                    {"gpu": chosen[scale]["gpu"], "efficiency": chosen[scale]["efficiency"]} if chosen else {}
                ),
                **r,
            }
            print(f"{scale}: {{{', '.join(f'{k}: {v}' for k, v in r.items())}}}")
        return 0
    rows = table_rows(plans)
    if args.format == "csv":
        import csv

        w = csv.writer(sys.stdout)
        w.writerow(COLUMNS)
        w.writerows(rows)
        sys.stdout.flush()
        return 0
    print("\n".join(textwrap.fill(line, 100, subsequent_indent="  ") for line in summary(plans).splitlines()))
    print()
    if args.details:
        _print_table(COLUMNS, rows)
    else:
        keep = [COLUMNS.index(c) for c in SHORT]
        _print_table(SHORT, [[r[i] for i in keep] for r in rows])
        print("\nTokens per call, memory by part and chunk sizes: --details (or --format csv).")
    sys.stdout.flush()  # a closed pipe shows here, inside main, not at interpreter exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
