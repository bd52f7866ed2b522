"""Aggregate finished runs into tables: `python -m marlflow.aggregate --runs PATH... --out results/tables`.

PATHs are metrics.parquet files; the samples.parquet beside each is read if present. Writes, atomically and
deterministically (sorted rows, no timestamps):

    summary.parquet, summary.csv, summary.md   one row per run (analysis.SUMMARY_COLUMNS)
    failures.csv                               run_id, cliff, collapse, stagnation, capture, evidence
    grad_dynamics.csv                          one row per run x role (analysis.GRAD_COLUMNS)
    peak_terminal.md, peak_terminal.tex        rows workflow x sharing, columns scale x task, "peak / terminal"
                                               (the held-out peak, else the cross-fitted one: the caption says)
    summary_by_cell.parquet, .csv, .md         one row per cell: mean and 95% CI over seeds
    contrasts.csv, contrasts.md                seed-paired SP - IP, MA - SA, intervention - none differences, CIs
    claims.csv, claims.md                      claims C1..C7: statistic, CI across seeds, verdict
    interventions.csv, interventions.md        each intervention minus none, pooled over cells and seeds (corrected)

OUTPUTS lists every file; rules/aggregate.smk declares exactly these. With one seed per cell every CI is
NaN in the csv/parquet; the md files then open with seeds.ONE_SEED_BANNER (how to get CIs) and show the
single values without CI columns. Definitions: marlflow.analysis.definitions.DEFINITIONS.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from marlflow.analysis import (
    failure_signatures,
    grad_dynamics,
    load_runs,
    markdown_table,
    peak_terminal_latex,
    peak_terminal_table,
    summarize_runs,
)
from marlflow.analysis.claims import VERDICT_RULE, claims_table
from marlflow.analysis.seeds import (
    ONE_SEED_BANNER,
    ci_markdown,
    contrasts,
    contrasts_markdown,
    one_seed,
    pooled_interventions,
    summary_by_cell,
)
from marlflow.analysis.tables import caption
from marlflow.metrics import atomic_write_parquet, atomic_write_text

OUTPUTS = [
    "summary.parquet",
    "summary.csv",
    "summary.md",
    "failures.csv",
    "grad_dynamics.csv",
    "peak_terminal.md",
    "peak_terminal.tex",
    "summary_by_cell.parquet",
    "summary_by_cell.csv",
    "summary_by_cell.md",
    "contrasts.csv",
    "contrasts.md",
    "claims.csv",
    "claims.md",
    "interventions.csv",
    "interventions.md",
]


def csv_text(df: pd.DataFrame) -> str:
    """Deterministic CSV text (no index, '\\n' line endings, shortest round-trip floats)."""
    return df.to_csv(index=False, lineterminator="\n")


def build_tables(metrics: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """All aggregate tables from loaded runs: summary, failures, grad_dynamics, peak_terminal,
    summary_by_cell, contrasts, claims."""
    summary = summarize_runs(metrics)
    grads = grad_dynamics(metrics)
    return {
        "summary": summary,
        "failures": failure_signatures(metrics, summary),
        "grad_dynamics": grads,
        "peak_terminal": peak_terminal_table(summary),
        "summary_by_cell": summary_by_cell(summary),
        "contrasts": contrasts(summary),
        "claims": claims_table(summary, grads),
        "interventions": pooled_interventions(summary),
    }


def write_tables(tables: dict[str, pd.DataFrame], out: str | os.PathLike) -> list[Path]:
    """Write the OUTPUTS files into `out` (created if needed); return their paths."""
    out = Path(out)
    s, pt = tables["summary"], tables["peak_terminal"]
    atomic_write_parquet(s, out / "summary.parquet")
    atomic_write_text(out / "summary.csv", csv_text(s))
    atomic_write_text(out / "summary.md", markdown_table(s, index=False))
    atomic_write_text(out / "failures.csv", csv_text(tables["failures"]))
    atomic_write_text(out / "grad_dynamics.csv", csv_text(tables["grad_dynamics"]))
    atomic_write_text(out / "peak_terminal.md", f"{caption(pt.attrs['peak'])}\n\n{markdown_table(pt)}")
    atomic_write_text(out / "peak_terminal.tex", peak_terminal_latex(pt))
    cells = tables["summary_by_cell"]
    banner = f"{ONE_SEED_BANNER}\n\n" if one_seed(s) else ""
    atomic_write_parquet(cells, out / "summary_by_cell.parquet")
    atomic_write_text(out / "summary_by_cell.csv", csv_text(cells))
    atomic_write_text(
        out / "summary_by_cell.md",
        banner
        + ("Value per cell (one run each).\n\n" if banner else "Mean [95% CI] over seeds per cell (n/a: fewer "
           "than 2 seeds).\n\n")
        + markdown_table(ci_markdown(cells), index=False),
    )  # fmt: skip
    con = tables["contrasts"]
    atomic_write_text(out / "contrasts.csv", csv_text(con))
    atomic_write_text(
        out / "contrasts.md",
        banner
        + ("Seed-paired differences of one pair of runs per row" if banner else "Seed-paired differences, mean "
           "[95% CI] over seeds")
        + " (sp-ip: SP minus IP; ma-sa: workflow minus single; itv-none: intervention minus none).\n\n"
        + markdown_table(contrasts_markdown(con), index=False),
    )  # fmt: skip
    claims = tables["claims"]
    atomic_write_text(out / "claims.csv", csv_text(claims))
    shown = claims.drop(columns=["rule"])
    atomic_write_text(
        out / "claims.md", f"{banner}Verdict rule: {VERDICT_RULE}.\n\n{markdown_table(shown, index=False)}"
    )
    itv = tables["interventions"]
    atomic_write_text(out / "interventions.csv", csv_text(itv))
    level = f"{itv['ci_level'].iloc[0]:.4g}" if len(itv) else "n/a"
    atomic_write_text(
        out / "interventions.md",
        "Each intervention minus none, paired by cell and seed and pooled over them (analysis.seeds."
        f"pooled_interventions); intervals Bonferroni-corrected over the {itv['intervention'].nunique()} "
        f"interventions (each at {level}); cliff: Newcombe's paired interval; verdict on the primary stat.\n\n"
        + (markdown_table(itv, index=False) if len(itv) else "No run with an intervention.\n"),
    )
    return [out / name for name in OUTPUTS]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="marlflow aggregate", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=[], metavar="PATH", help="metrics.parquet files")
    parser.add_argument("--out", required=True, help="output folder, e.g. results/tables")
    args = parser.parse_args(argv)
    try:
        metrics, _ = load_runs(args.runs)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"marlflow aggregate: error: {e}\n")
    paths = write_tables(build_tables(metrics), args.out)
    print(f"aggregated {metrics['run_id'].nunique()} runs into {len(paths)} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
