"""The HTML report: an overview page for the whole matrix and one page per run, plus the overview's figures.

The `marlflow report` command (also `python -m marlflow report`); its library is `marlflow.report.build`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from marlflow.report.build import default_pages_dir, make_report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="marlflow report", description=__doc__.splitlines()[0])
    parser.add_argument("--tables", required=True, help="folder written by marlflow.analysis.aggregate")
    parser.add_argument("--runs", nargs="*", default=[], metavar="PATH", help="metrics.parquet files")
    parser.add_argument("--figures", required=True, help="output folder for PNGs, e.g. results/figures")
    parser.add_argument("--html", required=True, help="overview page, e.g. results/report.html")
    parser.add_argument(
        "--pages", default=None, help="folder for one page per run (default: --html without .html)"
    )
    args = parser.parse_args(argv)
    try:
        written = make_report(args.tables, args.runs, args.figures, args.html, args.pages)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"marlflow report: error: {e}\n")
    pages = default_pages_dir(args.html) if args.pages is None else Path(args.pages)
    print(f"wrote {len(written)} files: figures in {args.figures}, run pages in {pages}")
    print(f"report: {Path(args.html).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
