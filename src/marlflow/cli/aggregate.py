"""Aggregate finished runs into tables: `python -m marlflow aggregate --runs PATH... --out results/tables`

PATHs are metrics.parquet files; the samples.parquet and outcomes.parquet beside each are read too.

The `marlflow aggregate` command (also `python -m marlflow aggregate`); its library is `marlflow.analysis.aggregate`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from marlflow.analysis import load_runs
from marlflow.analysis.aggregate import build_tables, check_analysis, write_tables
from marlflow.analysis.io import load_outcomes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="marlflow aggregate", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=[], metavar="PATH", help="metrics.parquet files")
    parser.add_argument("--out", required=True, help="output folder, e.g. results/tables")
    parser.add_argument(
        "--analysis",
        default="{}",
        metavar="JSON",
        help="the preset's declared analyses as JSON (its matrix.yaml `analysis:` block, "
        'marlflow.pipeline.matrix.analysis_of), e.g. \'{"interventions": {"compare": ["kl"]}}\'',
    )
    args = parser.parse_args(argv)
    try:
        analysis = json.loads(args.analysis)
        check_analysis(analysis)
    except ValueError as e:  # hand-written JSON (the rule passes what marlflow.pipeline.matrix validated)
        parser.exit(2, f"marlflow aggregate: error: --analysis {args.analysis!r}: {e}\n")
    try:
        metrics, _ = load_runs(args.runs)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"marlflow aggregate: error: {e}\n")
    paths = write_tables(build_tables(metrics, analysis, load_outcomes(args.runs)), args.out)
    print(f"aggregated {metrics['run_id'].nunique()} runs into {len(paths)} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
