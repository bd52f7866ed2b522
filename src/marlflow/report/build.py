"""The HTML report: an overview page for the whole matrix and one page per run, plus the overview's figures.

This module reads the inputs, renders the overview's sections and writes every file (`make_report`); the
findings box is `marlflow.report.findings`, provenance `marlflow.report.provenance`, the run pages
`marlflow.report.pages` and the HTML building blocks `marlflow.report.html`.

    python -m marlflow report --tables results/tables --runs results/runs/*/metrics.parquet \\
        --figures results/figures --html results/report.html [--pages results/report]

Reads the tables written by `python -m marlflow aggregate` (summary.parquet, failures.csv, grad_dynamics.csv
are required; contrasts.csv, summary_by_cell.csv and claims.csv are shown when present), each run's
metrics.parquet, and beside it, when present, samples.parquet (transcripts), config.json (preset, model,
hyperparameters) and DONE.

Output contract (rules/report.smk declares exactly these, generated from the names below, so the rule and
this module cannot drift; every file is written atomically, and the text is deterministic: no timestamps):

    <figures>/<name> for name in FIGURES      curves.png, grad_dynamics.png, role_share.png;
                                              solution_metrics.png only when a run's task has solution metrics
                                              (SOLUTION_FIGURE, marlflow.tasks.solution_metrics.names_of of the
                                              task names in the runs' config.json; otherwise the page says the
                                              tasks have none); interventions.png only when a run has an
                                              intervention (ITV_FIGURE; otherwise the page says there are none)
    <html>                                    the overview page (results/report.html)
    <pages>/RUN_PAGE for each run             one page per run, RUN_PAGE = "{run_id}.html"; <pages> defaults
                                              to the html path without its suffix (results/report/)

`outputs(figures, html, pages, run_ids, interventions, solution_metrics)` returns that list of paths. Every
page is self-contained: figures are embedded as base64 PNG, styles are inline, nothing is fetched from the
network; pages link to each other by relative paths.

The overview opens with a findings box (findings_section: the best and worst cell, SP - IP per workflow x
task with its CI or, with one seed, the evaluation noise, terminal cliffs, failure signatures and
format-failure rises, each with values and steps; a one-seed banner saying how to get CIs; a warning when a
toy base is outside definitions.TOY_BASE_BAND), then provenance (presets, models, git commit, the CPU and its
kernel capability, torch and threads, each toy model's weights hash, package versions, wall time), one row per
run linking to its page, eval curves (+- 1 SE bands, y axis shared per task), peak / terminal and the
paired SP - IP comparison with confidence intervals, the tasks' own solution metrics (e.g. the toy tasks'
share of careless-style solver outputs) where the tasks have them, failure signatures with their evidence,
gradient traces with each SP run next to its IP partner, and the definitions. A run page:
its settings, curves, per-role train and eval metrics, the step-time split and sample transcripts by step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from marlflow.analysis import DEFINITIONS, load_runs
from marlflow.analysis.io import read_samples
from marlflow.analysis.paired import SHARING_CONTRASTS
from marlflow.analysis.plots import (
    ITV_SMOOTH,
    plot_curves,
    plot_grad_norm,
    plot_interventions,
    plot_role_share,
    plot_solution_metrics,
    save_png,
    solution_series,
)
from marlflow.analysis.seeds import CELL, one_seed
from marlflow.analysis.tables import (
    SCALE_ORDER,
    SHARING_ORDER,
    TASK_ORDER,
    WORKFLOW_ORDER,
    caption,
    order_key,
    peak_terminal_table,
)
from marlflow.report.findings import failure_flags, findings_section, with_peak_se
from marlflow.report.html import cell_label, cell_order, duration, esc, figure, is_missing, page, table
from marlflow.report.pages import render_run_page
from marlflow.report.provenance import git_commit, provenance_section, read_json, train_seconds
from marlflow.store.atomic import atomic_write_text
from marlflow.store.schema import FACTOR_COLUMNS
from marlflow.tasks.solution_metrics import names_of as solution_metric_names

FIGURES = {
    "curves.png": (plot_curves, "Eval accuracy vs step"),
    "grad_dynamics.png": (plot_grad_norm, "Per-role gradient norm vs step"),
    "role_share.png": (plot_role_share, "Per-role share of the step's gradient mass"),
    "solution_metrics.png": (plot_solution_metrics, "Each task's own metrics of its solver outputs vs step"),
    "interventions.png": (plot_interventions, "Per-role gradient traces with and without each intervention"),
}
ITV_FIGURE = "interventions.png"  # drawn only when a run has an intervention
SOLUTION_FIGURE = (
    "solution_metrics.png"  # drawn only when a run's task has solution metrics; takes their names
)
RUN_PAGE = "{run_id}.html"
REQUIRED_TABLES = ["summary.parquet", "failures.csv", "grad_dynamics.csv"]
# Tables of the statistics step (marlflow.analysis.seeds / claims), shown when the aggregate step wrote them
OPTIONAL_TABLES = ["contrasts.csv", "summary_by_cell.csv", "claims.csv", "interventions.csv", "paired.csv",
                   "paired_cliffs.csv"]  # fmt: skip
MISSING_TABLE = (
    "{name} was not found next to summary.parquet: the aggregate step that wrote these tables predates it. "
    "Rerun <code>python -m marlflow aggregate</code> (or <code>make run</code>) with the current marlflow."
)


def outputs(
    figures_dir: str | os.PathLike,
    html_path: str | os.PathLike,
    pages_dir: str | os.PathLike | None,
    run_ids: Sequence[str],
    interventions: bool = False,
    solution_metrics: bool = False,
) -> list[Path]:
    """Every file make_report writes for these runs (the output contract in the module docstring);
    `interventions`: whether any run has an intervention (then ITV_FIGURE is drawn); `solution_metrics`:
    whether any run's task has solution metrics (then SOLUTION_FIGURE is drawn)."""
    pages = default_pages_dir(html_path) if pages_dir is None else Path(pages_dir)
    drawn = {ITV_FIGURE: interventions, SOLUTION_FIGURE: solution_metrics}
    return [
        *(Path(figures_dir) / name for name in FIGURES if drawn.get(name, True)),
        Path(html_path),
        *(pages / RUN_PAGE.format(run_id=r) for r in run_ids),
    ]


def default_pages_dir(html_path: str | os.PathLike) -> Path:
    """results/report.html -> results/report (the folder of the per-run pages)."""
    return Path(html_path).with_suffix("")


# ---------------------------------------------------------------------------- inputs


def read_tables(tables: str | os.PathLike) -> dict[str, object]:
    """Read aggregate outputs; FileNotFoundError naming the missing file (run marlflow.analysis.aggregate first).

    Optional tables (OPTIONAL_TABLES) that are absent are None.
    """
    tables = Path(tables)
    for name in REQUIRED_TABLES:
        if not (tables / name).is_file():
            raise FileNotFoundError(f"{tables / name} not found; run `python -m marlflow aggregate` first")
    out: dict[str, object] = {
        "summary": pd.read_parquet(tables / "summary.parquet"),
        "failures": pd.read_csv(tables / "failures.csv", keep_default_na=False),
        "grad_dynamics": pd.read_csv(tables / "grad_dynamics.csv"),
    }
    for name in OPTIONAL_TABLES:
        p = tables / name
        try:
            out[name] = pd.read_csv(p) if p.is_file() else None
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
            raise ValueError(
                f"{p}: not a readable CSV table ({e}); rerun `python -m marlflow aggregate`"
            ) from e
    return out


def run_files(metrics_paths: Sequence[str | os.PathLike], metrics: pd.DataFrame) -> dict[str, dict]:
    """Per run id: its folder's config.json and DONE (parsed, {} when absent) and samples.parquet (rows in
    call order, empty when absent)."""
    out = {}
    for p in map(Path, metrics_paths):
        folder = p.parent
        ids = sorted(pd.read_parquet(p, columns=["run_id"])["run_id"].unique())
        cfg = read_json(folder / "config.json")
        done = read_json(folder / "DONE")
        sp = folder / "samples.parquet"
        samples = read_samples(sp) if sp.is_file() else None
        for rid in ids:
            s = None if samples is None else samples[samples["run_id"] == rid]
            # file order is call order within an episode (generator0 before evaluator0); keep it
            s = (
                None
                if s is None
                else s.sort_values(["step", "episode"], kind="stable").reset_index(drop=True)
            )
            out[rid] = {"config": cfg, "done": done, "samples": s, "folder": folder}
    for rid in metrics["run_id"].unique():
        out.setdefault(rid, {"config": {}, "done": {}, "samples": None, "folder": None})
    return out


# ---------------------------------------------------------------------------- overview


def run_order(summary: pd.DataFrame) -> list[str]:
    """Run ids in paper order: workflow, scale, task, seed, intervention, then SP before IP (so each SP run
    is followed by its IP partner)."""
    wf, sc, tk, sh = (order_key(o) for o in (WORKFLOW_ORDER, SCALE_ORDER, TASK_ORDER, SHARING_ORDER))
    recs = summary[FACTOR_COLUMNS].to_dict("records")
    recs.sort(key=lambda r: (wf(r["workflow"]), sc(r["scale"]), tk(r["task"]), r["seed"],
                             r["intervention"] != "none", str(r["intervention"]), sh(r["sharing"]), r["run_id"]))  # fmt: skip
    return [r["run_id"] for r in recs]


def by_run_order(df: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    """Rows of a per-run (or per run x role) table in run order, stable within a run."""
    rank = {rid: i for i, rid in enumerate(order)}
    key = df["run_id"].astype(str).map(lambda r: rank.get(r, len(rank)))
    return df.assign(_k=key).sort_values("_k", kind="stable").drop(columns="_k").reset_index(drop=True)


def run_task_names(run_info: dict[str, dict]) -> dict[str, str]:
    """run id -> its registered task name (config.json task.name); runs without one are left out."""
    names = {rid: (info["config"].get("task") or {}).get("name") for rid, info in run_info.items()}
    return {rid: n for rid, n in names.items() if n}


def solution_names(run_info: dict[str, dict]) -> tuple[str, ...]:
    """The solution metrics (marlflow.tasks.solution_metrics) of the runs' tasks; empty: none has any."""
    return solution_metric_names(run_task_names(run_info).values())


def solution_first_last(metrics: pd.DataFrame, names: Sequence[str]) -> dict[str, dict[str, str]]:
    """run id -> {solution metric: 'first -> last eval value'} for the runs that log it."""
    out: dict[str, dict[str, str]] = {}
    for (rid, name), c in solution_series(metrics, names).groupby(["run_id", "metric"]):
        v = c.sort_values("step")["value"]
        out.setdefault(rid, {})[name] = f"{v.iloc[0]:.2f} -> {v.iloc[-1]:.2f}"
    return out


def runs_section(
    summary: pd.DataFrame, metrics: pd.DataFrame, failures: pd.DataFrame, links, solution: Sequence[str] = ()
) -> list[str]:
    """The Runs table; a column per solution metric in `solution` that a run logs (step 0 -> last eval)."""
    secs = train_seconds(metrics)
    firstlast = solution_first_last(metrics, solution)
    shown = [n for n in solution if any(n in v for v in firstlast.values())]
    flags = failure_flags(failures)
    summary = with_peak_se(summary, metrics)
    recs = []
    for rid in run_order(summary):
        r = summary[summary["run_id"] == rid].iloc[0]
        rec = {
            "run_id": rid,
            "base": r["base"],
            "peak_heldout": r["peak_heldout"],
            "peak_heldout_step": r["peak_heldout_step"] if pd.notna(r["peak_heldout_step"]) else None,
            "terminal": r["terminal"],
            "gain_heldout": r["gain_heldout"],
            "se": r["peak_se"],
            "peak_in_sample": r["peak"],
            "signatures": ", ".join(flags.get(rid, [])),
            "train_time": duration(float(secs.get(rid, math.nan))),
        }
        rec.update({n: firstlast.get(rid, {}).get(n, "") for n in shown})
        recs.append(rec)
    note = (
        "<p class='note'>One row per run; the run id links to its page (curves, per-role metrics, step time, "
        "transcripts). peak_heldout: the test accuracy at the step chosen on the validation problems "
        "(peak_heldout_step); gain_heldout = peak_heldout - base; se = standard error of the test evaluation at "
        "that step; peak_in_sample: the maximum over the test evaluations (selected on the numbers it reports: "
        "in-sample, optimistic; no finding uses it)"
        + (f"; {', '.join(shown)}: step 0 -> last eval (the task's solution metrics)" if shown else "")
        + ".</p>"
    )
    return ["<h2 id='runs'>Runs</h2>", note, table(pd.DataFrame(recs), links)]


def peak_terminal_html(summary: pd.DataFrame) -> str:
    """The paper-style table as HTML: a scale header row spanning its tasks, a task header row."""
    pt = peak_terminal_table(summary)
    if pt.empty:
        return "<p class='note'>No run has an eval accuracy.</p>"
    scales: list[list] = []
    for scale, _ in pt.columns:
        if scales and scales[-1][0] == scale:
            scales[-1][1] += 1
        else:
            scales.append([scale, 1])
    top = "<th rowspan='2'>workflow-sharing</th>" + "".join(
        f"<th colspan='{n}'>{esc(s)}</th>" for s, n in scales
    )
    sub = "".join(f"<th>{esc(t)}</th>" for _, t in pt.columns)
    rows = "".join(
        f"<tr><td>{esc(label)}</td>" + "".join(f'<td class="n">{esc(v)}</td>' for v in row) + "</tr>"
        for label, row in pt.iterrows()
    )
    return (
        f"<p class='note'>{esc(caption(pt.attrs['peak']))}</p><div class='tw'><table><thead><tr>{top}</tr>"
        f"<tr>{sub}</tr></thead>"
        f"<tbody>{rows}</tbody></table></div>"
    )


def ci_html(m: object, lo: object, hi: object, signed: bool = False, na: bool = True) -> str:
    """'mean' over '[lo, hi]' (escaped, two lines so wide CI tables fit); 'n/a' for a CI that needs 2 seeds,
    or the mean alone when `na` is False (a one-seed matrix: the Findings banner says why once)."""
    if is_missing(m):
        return ""
    text = f"{float(m):+.3f}" if signed else f"{float(m):.3f}"
    if not na and (is_missing(lo) or is_missing(hi)):
        return esc(text)
    ci = "n/a" if is_missing(lo) or is_missing(hi) else f"[{float(lo):.3f}, {float(hi):.3f}]"
    return f"{esc(text)}<br><span class='ci'>{esc(ci)}</span>"


def _need(df: pd.DataFrame, name: str, columns: Sequence[str]) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(
            f"{name} lacks columns {missing}; it was written by another marlflow version: rerun "
            "`python -m marlflow aggregate`"
        )


def contrasts_html(con: pd.DataFrame, kind: str) -> str:
    """One contrast kind (sp-ip, ma-sa or itv-none) as a table: a row per cell, a column per statistic, each
    cell the seed-paired mean difference over its 95% CI."""
    _need(con, "contrasts.csv", ["contrast", *CELL, "stat", "n_pairs", "mean", "lo", "hi"])
    c = con[con["contrast"] == kind]
    if c.empty:
        return f"<p class='note'>No {esc(kind)} pairs among these runs.</p>"
    single = one_seed(con)
    stats = [
        st for st in dict.fromkeys(c["stat"]) if not single or c.loc[c["stat"] == st, "mean"].notna().any()
    ]
    recs = []
    for key, g in cell_order(c).groupby(CELL, sort=False, dropna=False):
        rec = dict(zip(CELL, key))
        by = {r["stat"]: r for r in g.to_dict("records")}
        row = {
            "cell": cell_label(rec, sharing=kind not in SHARING_CONTRASTS),
            "seed pairs": int(g["n_pairs"].max()),
        }
        for st in stats:
            r = by.get(st)
            row[st] = "" if r is None else ci_html(r["mean"], r["lo"], r["hi"], signed=True, na=not single)
        recs.append(row)
    return table(pd.DataFrame(recs), raw_columns=stats)


def pooled_interventions_html(itv: pd.DataFrame | None) -> list[str]:
    """interventions.csv (aggregate: the preset's declared pooled analysis) as a table: a row per intervention
    and statistic, the difference from the baseline with its corrected interval, pairs, cells, the correction
    and the verdict (on the primary statistic only)."""
    if itv is None:
        return [f"<p class='note'>{MISSING_TABLE.format(name='interventions.csv')}</p>"]
    _need(itv, "interventions.csv", ["intervention", "baseline", "stat", "n_pairs", "mean", "lo", "hi", "ci_level",
                                     "correction", "verdict"])  # fmt: skip
    if itv.empty:
        return []
    recs = [
        {
            "intervention": f"{r['intervention']} - {r['baseline']}",
            "stat": r["stat"],
            "pairs": int(r["n_pairs"]),
            "difference": ci_html(r["mean"], r["lo"], r["hi"], signed=True),
            "level": f"{float(r['ci_level']):.4g}",
            "correction": r["correction"],
            "verdict": "" if is_missing(r["verdict"]) else r["verdict"],
        }
        for r in itv.to_dict("records")
    ]
    return [
        "<h3 id='pooled_interventions'>Pooled over cells and replicates</h3>",
        "<p class='note'>Each intervention minus the baseline, paired within cell and replicate and pooled, as "
        "the preset declares it in matrix.yaml (analysis.interventions; interventions.md says what was declared, "
        "or that nothing was). Intervals at the corrected level shown; cliff: Tango's paired interval; the "
        "verdict is on the declared statistic only. From interventions.csv.</p>",
        table(pd.DataFrame(recs), raw_columns=("difference",)),
    ]


def per_problem_html(pairs: pd.DataFrame | None, contrast: str) -> list[str]:
    """paired.csv's rows of `contrast` (analysis.paired: per-problem paired differences) as a table, the
    declared primary rows with their verdicts first; a note when the runs kept no outcomes."""
    if pairs is None or pairs.empty or not (pairs["contrast"] == contrast).any():
        return [
            "<p class='note'>No per-problem comparison: the runs kept no outcomes.parquet, or no pair.</p>"
        ]
    rows = pairs[pairs["contrast"] == contrast]
    rows = rows.assign(_d=rows["verdict"].eq("descriptive")).sort_values("_d", kind="stable")
    recs = [{"a - b": f"{r['a']} - {r['b']}", "at": r["at"], "workflow": r["workflow"], "task": r["task"],
             "replicates": r["n_rep"], "problems": r["n_prob"],
             "difference": ci_html(r["diff"], r["lo"], r["hi"], signed=True), "McNemar p": f"{r['p']:.3g}",
             "corr": f"{r['corr']:.2f}", "verdict": f"<span class='{esc(r['verdict'])}'>{esc(r['verdict'])}</span>"}
            for r in rows.to_dict("records")]  # fmt: skip
    return [
        "<p class='note'>Problem by problem on the same test problems, within each replicate, combined over "
        "replicates (analysis.paired; what was declared and the correction: paired.md). at heldout: each run "
        "read at the step its validation accuracy chose; terminal: its last evaluation (descriptive). corr: "
        "how alike the two arms' outcomes are per problem, which pairing gains from.</p>",
        table(pd.DataFrame(recs), raw_columns=("difference", "verdict")),
    ]


def contrasts_section(
    con: pd.DataFrame | None, itv: pd.DataFrame | None = None, pairs: pd.DataFrame | None = None
) -> list[str]:
    out = ["<h2 id='paired'>Paired SP - IP</h2>"]
    if con is None:
        return [*out, f"<p class='note'>{MISSING_TABLE.format(name='contrasts.csv')}</p>"]
    seeds = (
        "one seed: the difference of one pair of runs, no CI (see Findings)"
        if one_seed(con)
        else "mean over seeds with its 95% CI below it (n/a: fewer than 2 seeds)"
    )
    out += [
        "<p class='note'>SP minus IP for runs of the same cell and seed (same problems at every step), "
        f"{seeds}. Positive: SP higher; for cliff, SP more often. From contrasts.csv.</p>",
        contrasts_html(con, "sp-ip"),
        "<h3 id='per_problem'>SP - IP per problem</h3>",
        *per_problem_html(pairs, "sp-ip"),
        *(
            part
            for kind in ("sp-agent", "ip-agent")
            if (con["contrast"] == kind).any()
            for part in (
                f"<h3>{kind.split('-')[0].upper()} - AS (one adapter per agent)</h3>",
                f"<p class='note'>{kind.split('-')[0].upper()} minus AS for runs of the same cell and seed; AS trains "
                "one adapter per agent instance (each voter or worker its own). From contrasts.csv.</p>",
                contrasts_html(con, kind),
                *per_problem_html(pairs, kind),
            )
        ),
        "<h3>Multi-agent - single-agent (MA - SA)</h3>",
        "<p class='note'>Each workflow minus the single-agent baseline of the same scale, task and seed.</p>",
        contrasts_html(con, "ma-sa"),
    ]
    if (con["contrast"] == "itv-none").any():
        out += [
            "<h3 id='interventions'>Interventions - none</h3>",
            "<p class='note'>Each intervention's run minus the run without one (same workflow, sharing, scale, "
            "task and seed), mean over seeds with its 95% CI. For cliff: negative means fewer cliffs. The "
            "cells' own peak, terminal and cliff rate are in the summary by cell below.</p>",
            contrasts_html(con, "itv-none"),
            *pooled_interventions_html(itv),
            "<h3>Interventions - none per problem</h3>",
            *per_problem_html(pairs, "itv-none"),
        ]
    return out


def cells_section(cells: pd.DataFrame | None) -> list[str]:
    out = ["<h2 id='cells'>Summary by cell</h2>"]
    if cells is None:
        return [*out, f"<p class='note'>{MISSING_TABLE.format(name='summary_by_cell.csv')}</p>"]
    _need(cells, "summary_by_cell.csv", [*CELL, "n_seeds"])
    single = one_seed(cells)
    stats = [c.removesuffix("_mean") for c in cells.columns if c.endswith("_mean")]
    stats = [st for st in stats if not single or cells[f"{st}_mean"].notna().any()]
    recs = []
    for rec in cell_order(cells).to_dict("records"):
        row = {"cell": cell_label(rec), "seeds": rec["n_seeds"]}
        for st in stats:
            row[st] = ci_html(rec[f"{st}_mean"], rec.get(f"{st}_lo"), rec.get(f"{st}_hi"), na=not single)
        recs.append(row)
    note = (
        "One seed: each value is one run, no CI (see Findings)."
        if single
        else "Mean over seeds with its 95% CI below it (n/a: fewer than 2 seeds)."
    )
    return [
        *out,
        f"<p class='note'>{note} From summary_by_cell.csv.</p>",
        table(pd.DataFrame(recs), raw_columns=stats),
    ]


def claims_section(claims: pd.DataFrame | None) -> list[str]:
    out = ["<h2 id='claims'>Claims</h2>"]
    if claims is None:
        return [*out, f"<p class='note'>{MISSING_TABLE.format(name='claims.csv')}</p>"]
    _need(claims, "claims.csv", ["claim", "verdict"])
    rules = sorted({str(r) for r in claims.get("rule", pd.Series(dtype=str)).dropna()})
    shown = claims.drop(columns=[c for c in ("rule",) if c in claims.columns]).copy()
    shown["verdict"] = [f"<span class='{esc(v)}'>{esc(v)}</span>" for v in shown["verdict"].astype(str)]
    note = "".join(f"<p class='note'>Verdict rule: {esc(r)}.</p>" for r in rules)
    return [*out, note, table(shown, raw_columns=("verdict",))]


def failures_section(failures: pd.DataFrame, links) -> list[str]:
    flags = failure_flags(failures)
    recs, clean = [], []
    for rec in failures.to_dict("records"):
        rid = str(rec["run_id"])
        evidence = [e for e in str(rec.get("evidence", "")).split("; ") if e]
        if not flags[rid] and not evidence:
            clean.append(rid)
            continue
        items = "".join(f"<li>{esc(e)}</li>" for e in evidence)
        sig = ", ".join(flags[rid]) or "none"
        recs.append({"run_id": rid, "signature": f"<span class='flag'>{esc(sig)}</span>",
                     "evidence": f"<ul style='margin:0;padding-left:1.2em'>{items}</ul>"})  # fmt: skip
    out = [
        "<h2 id='failures'>Failure signatures</h2>",
        "<p class='note'>Cliff, collapse, stagnation and capture per run, with the numbers that triggered them "
        "(rules in Definitions).</p>",
    ]
    if recs:
        out.append(table(pd.DataFrame(recs), links, raw_columns=("signature", "evidence")))
    if clean:
        out.append(f"<p class='note'>No signature: {esc(', '.join(clean))}.</p>")
    return out


def solution_section(solution: Sequence[str], tasks: dict[str, str], figures: dict[str, bytes]) -> list[str]:
    """The tasks' own metrics of their solver outputs (marlflow.tasks.solution_metrics): the figure when the
    runs' tasks (`tasks`: run id -> task name) have any, else one line saying they have none."""
    head = "<h2 id='solution'>Solution metrics</h2>"
    listed = ", ".join(sorted(set(tasks.values()))) or "none recorded in config.json"
    if not solution:
        return [head, f"<p class='note'>None: these runs' tasks ({esc(listed)}) define no metrics of their "
                "solver outputs (marlflow.tasks.solution_metrics), so there is no figure.</p>"]  # fmt: skip
    return [
        head,
        f"<p class='note'>Each task's own metrics of the generator and worker eval outputs ({esc(', '.join(solution))}; "
        "marlflow.tasks.solution_metrics), e.g. what RL should teach the roles to drop. Step 0 -> last eval per "
        "run is in the Runs table.</p>",
        figure(figures[SOLUTION_FIGURE], SOLUTION_FIGURE),
    ]


GRAD_SHOWN = ["run_id", "role", "n_steps", "grad_norm_mean", "grad_norm_max", "grad_share_mean",
              "grad_share_early", "grad_share_late", "grad_share_shift", "norm_ratio", "dominant",
              "share_drop_corr"]  # fmt: skip


def render_overview(
    tables: dict[str, object],
    metrics: pd.DataFrame,
    figures: dict[str, bytes],
    run_info: dict[str, dict],
    links: dict[str, str],
    commit: str,
) -> str:
    """The overview page. Deterministic text for the same inputs, commit and package versions."""
    summary = tables["summary"]
    order = run_order(summary)
    failures = by_run_order(tables["failures"], order)
    solution = solution_names(run_info)
    sections = [("findings", "Findings"), ("provenance", "Provenance"), ("runs", "Runs"), ("curves", "Curves"),
                ("peak_terminal", "Peak / terminal"), ("paired", "Paired SP - IP")]  # fmt: skip
    sections.append(("solution", "Solution metrics"))
    sections += [("failures", "Failure signatures"), ("gradients", "Gradients"), ("cells", "By cell"),
                 ("claims", "Claims"), ("definitions", "Definitions")]  # fmt: skip
    body = [
        "<h1>marlflow report</h1>",
        "<nav>" + "".join(f"<a href='#{a}'>{esc(t)}</a>" for a, t in sections) + "</nav>",
        *findings_section(tables, metrics),
        *provenance_section(run_info, metrics, commit, summary),
        *runs_section(summary, metrics, failures, links, solution),
        "<h2 id='curves'>Eval accuracy vs step</h2>",
        "<p class='note'>Panels of one task share their y axis. Shaded: +- 1 standard error of the evaluation; "
        "dashed: each run's step-0 base. SP blue, IP red, single-agent green.</p>",
        figure(figures["curves.png"], "curves.png"),
        "<h2 id='peak_terminal'>Peak / terminal</h2>",
        peak_terminal_html(summary),
        *contrasts_section(
            tables.get("contrasts.csv"), tables.get("interventions.csv"), tables.get("paired.csv")
        ),
    ]
    body += solution_section(solution, run_task_names(run_info), figures)
    grads = by_run_order(tables["grad_dynamics"], order)
    body += [
        *failures_section(failures, links),
        "<h2 id='gradients'>Gradient traces</h2>",
        "<p class='note'>Each SP run (left) next to its IP partner (right). Under SP the per-role norms are "
        "each role's contribution to the one shared adapter's gradient.</p>",
        "<h3>Per-role gradient norm</h3>",
        "<p class='note'>One log y axis for every panel. Steps with no gradient (norm 0: every group's rewards "
        "equal) cannot be drawn on it: the line breaks there, and the panel counts them.</p>",
        figure(figures["grad_dynamics.png"], "grad_dynamics.png"),
        "<h3>Per-role share of the gradient mass</h3>",
        "<p class='note'>Stacked to 1 per step; grey hatched: no data (a step with no gradient, or a role not "
        "logged).</p>",
        figure(figures["role_share.png"], "role_share.png"),
        "<h3>Gradient dynamics (run x role)</h3>",
        table(grads[[c for c in GRAD_SHOWN if c in grads.columns]], links),
    ]
    if not (metrics["intervention"] != "none").any():
        body.append("<p class='note'>No interventions in this matrix (every run has intervention none), so "
                    "there is no with/without comparison.</p>")  # fmt: skip
    else:
        body += [
            "<h3 id='intervention_traces'>With and without each intervention</h3>",
            f"<p class='note'>Per role, the mean over seeds at each step (smoothed over {ITV_SMOOTH} steps) of "
            "the role's own-loss gradient norm, its projection share and its same-role slot amplification; a "
            "line per intervention, none in black. The seed-paired differences are in Interventions - none.</p>",
            figure(figures["interventions.png"], "interventions.png"),
        ]
    body += [
        *cells_section(tables.get("summary_by_cell.csv")),
        *claims_section(tables.get("claims.csv")),
        "<h2 id='definitions'>Definitions</h2>",
        f"<pre>{esc(DEFINITIONS)}</pre>",
    ]
    return page("marlflow report", body)


# ---------------------------------------------------------------------------- driver


def _href(target: Path, start: Path) -> str:
    return Path(os.path.relpath(target, start)).as_posix()


def make_report(
    tables_dir: str | os.PathLike,
    runs: Sequence[str | os.PathLike],
    figures_dir: str | os.PathLike,
    html_path: str | os.PathLike,
    pages_dir: str | os.PathLike | None = None,
    commit: str | None = None,
) -> dict[str, Path]:
    """Write the FIGURES, the overview page and one page per run; return {name: path} of every file written
    (exactly `outputs(...)`). `commit` defaults to git_commit() of the working directory."""
    tables = read_tables(tables_dir)
    metrics, _ = load_runs(runs)
    run_info = run_files(runs, metrics)
    html_path, figures_dir = Path(html_path), Path(figures_dir)
    pages = default_pages_dir(html_path) if pages_dir is None else Path(pages_dir)
    commit = git_commit() if commit is None else commit
    written, pngs = {}, {}
    interventions = bool((metrics["intervention"] != "none").any())
    solution = solution_names(run_info)
    tasks = run_task_names(run_info)
    # a placeholder would be an empty figure; the page says there are no interventions / solution metrics
    drawn = {ITV_FIGURE: interventions, SOLUTION_FIGURE: bool(solution)}
    for name, (plot, _) in FIGURES.items():
        if not drawn.get(name, True):
            continue
        fig = plot(metrics, solution) if name == SOLUTION_FIGURE else plot(metrics)
        pngs[name] = save_png(fig, figures_dir / name)
        written[name] = figures_dir / name
    order = run_order(tables["summary"])
    order += sorted(set(metrics["run_id"]) - set(order))
    page_paths = {rid: pages / RUN_PAGE.format(run_id=rid) for rid in order}
    links = {rid: _href(p, html_path.parent) for rid, p in page_paths.items()}
    atomic_write_text(html_path, render_overview(tables, metrics, pngs, run_info, links, commit))
    written[html_path.name] = html_path
    summary = tables["summary"].set_index("run_id", drop=False)
    failures = tables["failures"].astype({"run_id": str}).set_index("run_id", drop=False)
    by_run = dict(tuple(metrics.groupby("run_id", sort=False)))
    for i, rid in enumerate(order):
        nav = tuple(
            _href(page_paths[order[j]], pages) if 0 <= j < len(order) else None for j in (i - 1, i + 1)
        )
        text = render_run_page(
            rid,
            by_run[rid],
            run_info[rid],
            summary.loc[rid].to_dict() if rid in summary.index else None,
            failures.loc[rid].to_dict() if rid in failures.index else None,
            _href(html_path, pages),
            nav,
            solution_metric_names([tasks[rid]] if rid in tasks else []),
        )
        atomic_write_text(page_paths[rid], text)
        written[f"pages/{page_paths[rid].name}"] = page_paths[rid]
    return written
