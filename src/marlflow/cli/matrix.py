"""matrix.yaml -> run sheet: one row per training run, validated up front.

The `marlflow matrix` command (also `python -m marlflow matrix`); its library is `marlflow.pipeline.matrix`.
"""

from __future__ import annotations

import argparse
import json
import sys

import pandas as pd

from marlflow.pipeline.matrix import AXES, MatrixError, check_run_ids, only_overrides, run_sheet


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="marlflow matrix", description="Validate matrix.yaml and print a preset's run sheet."
    )
    ap.add_argument("file", nargs="?", default="matrix.yaml", help="matrix file (default: matrix.yaml)")
    ap.add_argument("--preset", help="preset to expand (default: the file's default_preset)")
    ap.add_argument(
        "--only", nargs="*", default=[], metavar="AXIS=V1,V2", help="restrict axes, e.g. workflow=voting"
    )
    ap.add_argument("--json", action="store_true", help="print the run sheet as JSON records")
    args = ap.parse_args(argv)
    try:
        sheet = run_sheet(args.file, args.preset, only_overrides(args.only))
        check_run_ids(args.file)
    except MatrixError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        recs = [{"run_id": rid, **row, "config": json.loads(row["config"])} for rid, row in sheet.iterrows()]
        print(json.dumps(recs, indent=2))
    else:
        with pd.option_context("display.max_rows", None, "display.width", 200):
            print(sheet[list(AXES)].to_string())
        print(f"{len(sheet)} runs (preset {sheet['preset'].iloc[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
