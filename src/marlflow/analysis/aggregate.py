"""Aggregate finished runs into tables: `python -m marlflow aggregate --runs PATH... --out results/tables
[--analysis JSON]`.

PATHs are metrics.parquet files; the samples.parquet and outcomes.parquet beside each are read if present. Writes, atomically and
deterministically (sorted rows, no timestamps):

    summary.parquet, summary.csv, summary.md   one row per run (analysis.SUMMARY_COLUMNS)
    failures.csv                               run_id, cliff, collapse, stagnation, capture, evidence
    grad_dynamics.csv                          one row per run x role (analysis.GRAD_COLUMNS)
    peak_terminal.md, peak_terminal.tex        rows workflow x sharing, columns scale x task, "peak / terminal"
                                               (the held-out peak, else the cross-fitted one: the caption says)
    summary_by_cell.parquet, .csv, .md         one row per cell: mean and 95% CI over seeds
    contrasts.csv, contrasts.md                seed-paired SP - IP, MA - SA, intervention - none differences, CIs
    claims.csv, claims.md                      claims C1..C7: statistic, CI across seeds, verdict
    interventions.csv, interventions.md        each intervention minus the baseline, pooled over cells and
                                               replicates, as the preset declares it (--analysis: its matrix.yaml
                                               `analysis: {interventions: ...}`, which rules/aggregate.smk passes)
    paired.csv, paired.md                      per-problem paired SP - IP and intervention - none differences at
                                               the validation-chosen step and the terminal (analysis.paired; as
                                               declared in `analysis: {paired: ...}`), from outcomes.parquet
    paired_cliffs.csv                          per run: test outcomes at the validation-chosen step vs terminal,
                                               exact McNemar (the paired cliff test)

OUTPUTS lists every file; rules/aggregate.smk declares exactly these. With one seed per cell every CI is
NaN in the csv/parquet; the md files then open with seeds.ONE_SEED_BANNER (how to get CIs) and show the
single values without CI columns. Definitions: marlflow.core.definitions.DEFINITIONS.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from marlflow.analysis import (
    failure_signatures,
    grad_dynamics,
    markdown_table,
    peak_terminal_latex,
    peak_terminal_table,
    summarize_runs,
)
from marlflow.analysis.claims import VERDICT_RULE, claims_table
from marlflow.analysis.paired import check_declared, paired_cliffs, paired_contrasts, paired_markdown
from marlflow.analysis.seeds import (
    CORRECTIONS,
    INTERVENTION_PRIMARY,
    INTERVENTION_STATS,
    ONE_SEED_BANNER,
    ci_markdown,
    contrasts,
    contrasts_markdown,
    one_seed,
    pooled_interventions,
    summary_by_cell,
)
from marlflow.analysis.tables import caption
from marlflow.store.atomic import atomic_write_parquet, atomic_write_text

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
    "paired.csv",
    "paired.md",
    "paired_cliffs.csv",
]


def csv_text(df: pd.DataFrame) -> str:
    """Deterministic CSV text (no index, '\\n' line endings, shortest round-trip floats)."""
    return df.to_csv(index=False, lineterminator="\n")


# analysis.interventions key of matrix.yaml -> keyword of seeds.pooled_interventions
DECLARED_KEYS = {"compare": "interventions", "statistic": "primary", "baseline": "baseline", "pair_by": "pair_by",
                 "correction": "correction"}  # fmt: skip


ANALYSES = ("interventions", "paired")  # what matrix.yaml `analysis:` may declare


def check_analysis(analysis: object) -> None:
    """Raise ValueError naming what is wrong unless `analysis` is a declaration aggregate can compute: an
    object with at most `interventions` (keys DECLARED_KEYS, listing `compare`) and `paired`
    (analysis.paired.check_declared)."""
    if not isinstance(analysis, dict):
        raise ValueError("not a JSON object")
    if set(analysis) - set(ANALYSES):
        raise ValueError(
            f"unknown analyses {sorted(set(analysis) - set(ANALYSES))}; known: {', '.join(ANALYSES)}"
        )
    if "paired" in analysis:
        check_declared(analysis["paired"])
    ia = analysis.get("interventions")
    if ia is None:
        return
    if not isinstance(ia, dict) or "compare" not in ia or set(ia) - set(DECLARED_KEYS):
        raise ValueError(
            f"interventions needs `compare` and takes only {', '.join(DECLARED_KEYS)}; got {ia!r}"
        )
    if ia.get("statistic", INTERVENTION_PRIMARY) not in INTERVENTION_STATS:
        raise ValueError(f"statistic {ia['statistic']!r} is not one of {', '.join(INTERVENTION_STATS)}")
    if ia.get("correction", "bonferroni") not in CORRECTIONS:
        raise ValueError(f"correction {ia['correction']!r} is not one of {', '.join(CORRECTIONS)}")


def interventions_table(summary: pd.DataFrame, declared: dict | None) -> pd.DataFrame:
    """The pooled intervention table as the preset declares it (matrix.yaml analysis.interventions, validated
    by marlflow.pipeline.matrix); without a declaration every intervention present against none, post hoc. The
    declaration, or None, is kept in the result's attrs["declared"] for the .md heading."""
    kw = {DECLARED_KEYS[k]: v for k, v in (declared or {}).items()}
    out = pooled_interventions(summary, **kw)
    out.attrs["declared"] = declared
    return out


def build_tables(
    metrics: pd.DataFrame, analysis: dict | None = None, outcomes: pd.DataFrame | None = None
) -> dict[str, pd.DataFrame]:
    """All aggregate tables from loaded runs: summary, failures, grad_dynamics, peak_terminal,
    summary_by_cell, contrasts, claims, interventions, and from their per-problem outcomes (load_outcomes;
    None or empty: the paired tables are empty) paired and paired_cliffs. analysis: the preset's declared
    analyses (marlflow.pipeline.matrix.analysis_of), {} or None when it declares none."""
    summary = summarize_runs(metrics)
    grads = grad_dynamics(metrics)
    declared_pairs = (analysis or {}).get("paired")
    pairs = paired_contrasts(outcomes, summary, declared_pairs)
    pairs.attrs["declared"] = declared_pairs
    return {
        "paired": pairs,
        "paired_cliffs": paired_cliffs(outcomes, summary),
        "summary": summary,
        "failures": failure_signatures(metrics, summary),
        "grad_dynamics": grads,
        "peak_terminal": peak_terminal_table(summary),
        "summary_by_cell": summary_by_cell(summary),
        "contrasts": contrasts(summary),
        "claims": claims_table(summary, grads),
        "interventions": interventions_table(summary, (analysis or {}).get("interventions")),
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
        + " (sp-ip: SP minus IP; sp-agent, ip-agent: SP or IP minus one adapter per agent; ma-sa: workflow minus "
        "single; itv-none: intervention minus none).\n\n"
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
    atomic_write_text(
        out / "interventions.md",
        interventions_heading(itv)
        + (markdown_table(itv, index=False) if len(itv) else "No run with an intervention.\n"),
    )
    pairs = tables["paired"]
    atomic_write_text(out / "paired.csv", csv_text(pairs))
    atomic_write_text(out / "paired.md", paired_markdown(pairs, pairs.attrs.get("declared")))
    atomic_write_text(out / "paired_cliffs.csv", csv_text(tables["paired_cliffs"]))
    return [out / name for name in OUTPUTS]


def interventions_heading(itv: pd.DataFrame) -> str:
    """The paragraph above interventions.md's table: what was declared, how pairs are made, the correction."""
    d = itv.attrs.get("declared")
    if len(itv) == 0:
        return "Pooled intervention analysis (analysis.seeds.pooled_interventions).\n\n"
    level, corr = f"{itv['ci_level'].iloc[0]:.4g}", str(itv["correction"].iloc[0])
    m, base = itv["intervention"].nunique(), str(itv["baseline"].iloc[0])
    how = (
        f"Declared in the preset before the runs (matrix.yaml analysis.interventions: {json.dumps(d)})"
        if d
        else "Not declared in the preset (no analysis.interventions in matrix.yaml): every intervention present "
        "against none, chosen after the runs"
    )
    pairs = ", ".join(d["pair_by"]) if d and d.get("pair_by") else "cell and replicate"
    corrected = f"{corr}-corrected over the {m} interventions" if corr != "none" else "not corrected"
    return (
        f"{how}. Each intervention minus {base}, paired by {pairs} and pooled (analysis.seeds."
        f"pooled_interventions); correction: {corr}: intervals {corrected} (each at {level}); cliff: Tango's "
        "paired interval; verdict on the primary stat.\n\n"
    )
