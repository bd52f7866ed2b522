"""Figures and a self-contained HTML report:

    python -m marlflow.report --tables results/tables --runs PATH... --figures results/figures \\
        --html results/report.html

Reads the tables written by `python -m marlflow.aggregate` (summary.parquet, failures.csv, grad_dynamics.csv,
peak_terminal.md) and the runs' metrics.parquet files (for the curves). Writes, atomically:
curves.png (eval accuracy vs step, panel per workflow x task), grad_dynamics.png (per-role grad_norm vs step,
panel per run), role_share.png (per-role grad_share, stacked, panel per run) and report.html (figures
embedded as base64 PNG, summary, failure signatures, gradient dynamics, definitions).
"""

from __future__ import annotations

import argparse
import base64
import html
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from marlflow.analysis import DEFINITIONS, load_runs
from marlflow.analysis.plots import plot_curves, plot_grad_norm, plot_role_share, save_png
from marlflow.metrics import atomic_write_text

FIGURES = {
    "curves.png": (plot_curves, "Eval accuracy vs step (dashed: each run's step-0 base)"),
    "grad_dynamics.png": (plot_grad_norm, "Per-role gradient norm vs step"),
    "role_share.png": (plot_role_share, "Per-role share of the step's gradient mass"),
}
TABLE_FILES = ["summary.parquet", "failures.csv", "grad_dynamics.csv", "peak_terminal.md"]
STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1400px}"
    "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px}"
    "th{background:#eee}img{max-width:100%}pre{background:#f7f7f7;padding:1em;white-space:pre-wrap}"
)


def read_tables(tables: str | os.PathLike) -> dict[str, object]:
    """Read aggregate outputs; FileNotFoundError naming the missing file (run marlflow.aggregate first)."""
    tables = Path(tables)
    for name in TABLE_FILES:
        if not (tables / name).is_file():
            raise FileNotFoundError(f"{tables / name} not found; run `python -m marlflow.aggregate` first")
    return {
        "summary": pd.read_parquet(tables / "summary.parquet"),
        "failures": pd.read_csv(tables / "failures.csv", keep_default_na=False),
        "grad_dynamics": pd.read_csv(tables / "grad_dynamics.csv"),
        "peak_terminal_md": (tables / "peak_terminal.md").read_text(),
    }


def html_table(df: pd.DataFrame) -> str:
    """An escaped HTML table with 3-decimal floats."""
    return df.to_html(index=False, float_format=lambda x: f"{x:.3f}", na_rep="", border=0, escape=True)


def render_html(tables: dict[str, object], figures: dict[str, bytes]) -> str:
    """The report page: figures embedded as base64 PNG, tables, definitions. Deterministic text."""
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8"><title>marlflow report</title>',
        f"<style>{STYLE}</style></head><body>",
        "<h1>marlflow report</h1>",
    ]
    for name, data in figures.items():
        caption = FIGURES[name][1]
        b64 = base64.b64encode(data).decode("ascii")
        parts += [f"<h2>{html.escape(caption)}</h2>", f'<img alt="{name}" src="data:image/png;base64,{b64}">']
    parts += [
        "<h2>Peak / terminal</h2>",
        f"<pre>{html.escape(tables['peak_terminal_md'])}</pre>",
        "<h2>Summary (one row per run)</h2>",
        html_table(tables["summary"]),
        "<h2>Failure signatures</h2>",
        html_table(tables["failures"]),
        "<h2>Gradient dynamics (run x role)</h2>",
        html_table(tables["grad_dynamics"]),
        "<h2>Definitions</h2>",
        f"<pre>{html.escape(DEFINITIONS)}</pre>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def make_report(
    tables_dir: str | os.PathLike,
    runs: Sequence[str | os.PathLike],
    figures_dir: str | os.PathLike,
    html_path: str | os.PathLike,
) -> dict[str, Path]:
    """Write the three figures and the HTML page; return {name: path}."""
    tables = read_tables(tables_dir)
    metrics, _ = load_runs(runs)
    figures_dir = Path(figures_dir)
    written, pngs = {}, {}
    for name, (plot, _) in FIGURES.items():
        pngs[name] = save_png(plot(metrics), figures_dir / name)
        written[name] = figures_dir / name
    atomic_write_text(html_path, render_html(tables, pngs))
    written["report.html"] = Path(html_path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m marlflow.report", description=__doc__.splitlines()[0])
    parser.add_argument("--tables", required=True, help="folder written by marlflow.aggregate")
    parser.add_argument("--runs", nargs="*", default=[], metavar="PATH", help="metrics.parquet files")
    parser.add_argument("--figures", required=True, help="output folder for PNGs, e.g. results/figures")
    parser.add_argument("--html", required=True, help="output HTML file, e.g. results/report.html")
    args = parser.parse_args(argv)
    try:
        written = make_report(args.tables, args.runs, args.figures, args.html)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"marlflow.report: error: {e}\n")
    print(f"wrote {', '.join(str(p) for p in written.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
