"""Memory and time planner: will a run fit on a GPU, and how long will it take?

The `marlflow plan` command (also `python -m marlflow plan`); its library is `marlflow.pipeline.plan`.

    marlflow plan --preset paper              # the summary, then one short row per run (fits 100 columns)
    marlflow plan --preset paper --details    # every column: tokens per call, memory by part, ...
    marlflow plan --preset paper --format csv # every column, as CSV
    marlflow plan --preset paper --all-rounds # the old bound: every Eval-Opt round and worker runs
    marlflow plan --from-run results/runs/ID  # re-plan one run from its first logged steps: real ETA
    marlflow plan --preset paper --only sharing=agent workflow=voting  # restrict or replace axes
    marlflow plan --preset paper --only scale=0.6b --run adapter=full backend=hf  # full fine-tuning cells

Time is a range over what the policies do (docs/planner.md, "Behaviour"): by default the default behaviour
(Eval-Opt continuation, Orch-Workers' workers, completion cv) at mean completions of 25% and 50% of the cap;
--all-rounds gives the old bound instead. Every GPU figure is a planner prediction.

--from-run RUN reads RUN/config.json and the metrics its trainer logged (RUN/metrics.parquet, or the newest
checkpoint's while it runs): each role's calls and completion lengths, Eval-Opt's continuation and
Orch-Workers' worker count in its first --steps train steps. It prints tokens per step planned with that
behaviour against logged, the logged seconds per step and per evaluation, the hours left at that pace, and
the SLURM runtime to give the rest of the run (hours left + 25%, at most --job-limit-min) with the
submissions it needs; for a CUDA run also the planner's step time with the logged behaviour.

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
    replan,
    resources,
    run_settings,
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


def _parser() -> argparse.ArgumentParser:
    # The docstring's paragraphs on the time range and --from-run, after the options.
    epilog = __doc__[__doc__.index("Time is a range") : __doc__.index("Output cut short")].strip()
    ap = argparse.ArgumentParser(prog="marlflow plan", description=__doc__.splitlines()[0], epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--matrix", default="matrix.yaml", help="matrix file (default: matrix.yaml)")
    ap.add_argument("--preset", help="preset to plan (default: the file's default_preset)")
    ap.add_argument("--only", nargs="*", default=[], metavar="AXIS=V1,V2",
                    help="restrict or replace axes as `marlflow matrix --only` does, e.g. sharing=agent "
                         "(one adapter per agent instance; cells of a workflow without a parallel role are skipped)")  # fmt: skip
    ap.add_argument("--run", nargs="*", default=[], metavar="KEY=VALUE",
                    help="replace run-level settings (a preset's `run:` keys) of every run, e.g. adapter=full "
                         "backend=hf: full fine-tuning, one whole model per policy (vLLM serves LoRA only)")  # fmt: skip
    ap.add_argument("--gpu", default="h100-80gb", choices=list(GPUS), help="GPU kind (default: h100-80gb)")
    ap.add_argument("--n-gpus", type=int, default=None,
                    help="data-parallel GPUs per run (default: each run's ranks in matrix.yaml)")  # fmt: skip
    ap.add_argument("--all-rounds", action="store_true",
                    help="time the old bound: every Eval-Opt round and Orch-Workers worker runs, completions at "
                         "25%%-100%% of the cap (default: the default behaviour at 25%%-50%%)")  # fmt: skip
    ap.add_argument("--from-run", metavar="RUN",
                    help="re-plan one run from its run folder's logged first steps: tokens per step, step time, "
                         "hours left and the SLURM runtime for the rest")  # fmt: skip
    ap.add_argument("--steps", type=int, default=None,
                    help="with --from-run: re-plan as of the first N logged train steps (default: all logged)")  # fmt: skip
    ap.add_argument("--format", choices=["md", "csv"], default="md",
                    help="table format (default md); csv has every column")  # fmt: skip
    ap.add_argument("--details", action="store_true",
                    help="every column in the md table: tokens per call, memory by part, chunk sizes")  # fmt: skip
    ap.add_argument("--resources", action="store_true",
                    help="print per-scale runtime (minutes: the longest run, top of its range, at most "
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
    return ap


def _main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from marlflow.pipeline.matrix import MatrixError, only_overrides

    if args.from_run:
        return _from_run(args)
    only = only_overrides(args.only)
    try:
        run = run_settings(dict(item.partition("=")[::2] for item in args.run))
        plans = plan_sheet(args.matrix, args.preset, args.gpu, args.n_gpus, args.all_rounds, only, run)
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
            by_n = {1: plan_sheet(args.matrix, args.preset, args.gpu, 1, args.all_rounds, only, run),
                    **{n: plan_sheet(args.matrix, args.preset, args.gpu, n, args.all_rounds, only, run)
                       for n in counts[1:]}}  # fmt: skip
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


def _from_run(args) -> int:
    """--from-run: the re-plan of one run folder (pipeline.plan.replan), as a few lines."""
    from marlflow.core.config import ConfigError

    try:
        r = replan(args.from_run, args.gpu, args.n_gpus, args.steps, args.job_limit_min)
    except (PlanError, ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    b, logged = r["behaviour"], r["tokens_logged"]
    comp = ", ".join(f"{k} {v:.1f}" for k, v in b.completion.items())
    extra = [f"continuation {b.continue_frac:.2f}"] if b.continue_frac < 1 else []
    extra += [f"workers per episode {b.workers:.2f}"] if b.workers is not None else []
    mean = sum(logged) / len(logged)
    lines = [
        f"run {r['run_id']}: {r['steps_done']} of {r['steps']} steps logged; behaviour from {b.source}: mean "
        f"completion tokens {comp}; {', '.join(extra + [f'completion cv {b.cv:.2f}'])}.",
        f"Tokens per step: planned {r['tokens_planned']:,.0f} with that behaviour; logged {mean:,.0f} (mean of "
        f"{len(logged)} step(s), {min(logged):,.0f}-{max(logged):,.0f}; planned / logged "
        f"{r['tokens_planned'] / mean:.2f}).",
        f"Logged: {r['step_s_logged']:,.1f} s per step, {r['eval_s_logged']:,.1f} s per evaluation "
        f"({r['eval_from']}; {r['evals_left']} left).",
    ]
    if r["step_s_planned"] is not None:
        lines.append(f"Planner prediction with that behaviour ({r['gpu']}): {r['step_s_planned']:,.1f} s per step "
                     f"(evaluations included), {r['run_hours_planned']:,.1f} h for the whole run.")  # fmt: skip
    lines += [
        f"Hours left at the logged pace: {r['hours_left']:,.2f} ({r['steps'] - r['steps_done']} steps).",
        f"SLURM runtime for the rest: {r['runtime_min']} min (hours left + 25%, at most {args.job_limit_min}); "
        f"{r['submissions']} submission(s).",
    ]
    print("\n".join(textwrap.fill(line, 100, subsequent_indent="  ") for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
