"""The HTML report: an overview page for the whole matrix and one page per run, plus the overview's figures.

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

import base64
import html
import importlib.metadata
import json
import math
import os
import platform
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from marlflow.analysis import DEFINITIONS, load_runs
from marlflow.analysis.curves import eval_curves, eval_sizes, peak_se, wide
from marlflow.analysis.io import read_samples
from marlflow.analysis.plots import (
    ITV_SMOOTH,
    TIME_PARTS,
    plot_curves,
    plot_grad_norm,
    plot_interventions,
    plot_role_share,
    plot_run,
    plot_solution_metrics,
    plot_step_time,
    png_bytes,
    save_png,
    solution_series,
    step_time_table,
    with_se,
)
from marlflow.analysis.seeds import ONE_SEED_BANNER, n_replicates, one_seed
from marlflow.analysis.tables import (
    PEAK_ESTIMATES,
    SCALE_ORDER,
    SHARING_ORDER,
    TASK_ORDER,
    WORKFLOW_ORDER,
    caption,
    order_key,
    peak_estimate,
    peak_terminal_table,
)
from marlflow.core.definitions import FORMAT_RISE, TOY_BASE_BAND
from marlflow.store.atomic import atomic_write_text
from marlflow.store.schema import FACTOR_COLUMNS
from marlflow.tasks.solution_metrics import names_of as solution_metric_names
from marlflow.training import environment

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
OPTIONAL_TABLES = ["contrasts.csv", "summary_by_cell.csv", "claims.csv", "interventions.csv"]
CELL_KEYS = ["workflow", "sharing", "scale", "task", "intervention"]
MISSING_TABLE = (
    "{name} was not found next to summary.parquet: the aggregate step that wrote these tables predates it. "
    "Rerun <code>python -m marlflow aggregate</code> (or <code>make run</code>) with the current marlflow."
)
PACKAGES = ["marlflow", "torch", "transformers", "trl", "peft", "accelerate", "vllm", "snakemake", "pandas",
            "matplotlib"]  # fmt: skip
TRANSCRIPT_CHARS = 4000  # longer prompts/outputs are cut (the full text stays in samples.parquet)

FINDINGS_BG = "#fff3cd"  # the findings box's background, used by no other element: tests find the box by it
STYLE = """
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;padding:1em 2em;
  max-width:1200px;color:#222;line-height:1.4;background:#fff}
h1{font-size:1.6em;margin:.3em 0}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}
h3{font-size:1.05em;margin-top:1.2em}
nav{margin:.5em 0 1em;font-size:.9em}nav a{margin-right:1em}
a{color:#1a5fb4}
.note{color:#555;font-size:.9em;margin:.3em 0}
.tw{overflow-x:auto;max-width:100%;margin:.4em 0 1.2em}
table{border-collapse:collapse;font-size:13px;max-width:100%}
th,td{border:1px solid #d0d0d0;padding:3px 7px;text-align:left;vertical-align:top;overflow-wrap:break-word}
th{background:#f0f0f0;font-weight:600}
td.n{text-align:right;font-variant-numeric:tabular-nums}
tr:nth-child(even) td{background:#fafafa}
.flag{color:#b00020;font-weight:600}
img{max-width:100%;height:auto;display:block;margin:.4em 0}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f6f6f6;border:1px solid #e4e4e4;
  padding:.4em .6em;margin:.2em 0 .6em;font-size:12px}
details{margin:.3em 0}summary{cursor:pointer}
.call{border-left:3px solid #ccc;padding-left:.7em;margin:.5em 0 .8em}
.ok{color:#1b7f3b}.bad{color:#b00020}
.kv td:first-child{font-weight:600;background:#f6f6f6;white-space:nowrap}
.kv td:last-child{overflow-wrap:anywhere}
.ci{color:#666;font-size:11px;white-space:nowrap}
.supported{color:#1b7f3b;font-weight:600}.contradicted{color:#b00020;font-weight:600}
.findings{background:FINDINGS_BG;border:2px solid #d9a520;border-radius:6px;padding:.4em 1.2em .5em;
  margin:.6em 0 1.2em;font-size:.92em;line-height:1.35}
.findings h2{margin:.1em 0 .2em;border:0}.findings ul{margin:.1em 0;padding-left:1.2em}.findings li{margin:.15em 0}
.banner{font-weight:600;color:#6b4700;margin:.2em 0 .4em}.warn{color:#b00020;font-weight:600}
""".replace("FINDINGS_BG", FINDINGS_BG)


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
            raise FileNotFoundError(
                f"{tables / name} not found; run `python -m marlflow aggregate` first"
            )
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
        cfg = _read_json(folder / "config.json")
        done = _read_json(folder / "DONE")
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


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it or rerun the job that writes it") from e
    return obj if isinstance(obj, dict) else {}


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """HEAD of the repository the report is built in ('+ uncommitted changes' when tracked files differ), or
    'unknown (not a git checkout)' (environment.source_commit)."""
    commit = environment.source_commit(cwd or os.getcwd())
    if not commit:
        return "unknown (not a git checkout)"
    return commit.replace("+dirty", " + uncommitted changes")


def package_versions() -> dict[str, str]:
    """Python and the installed versions of PACKAGES ('not installed' when absent)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


# ---------------------------------------------------------------------------- HTML helpers


def esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def _missing(v: object) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float | np.floating) and math.isnan(v))


def number_format(values) -> str:
    """One format for a group of numbers (a column, or a row of a metric x step table), so they line up:
    'd' for integers, and for whole floats when one reaches 2 (counts such as n_eval, not accuracies of 0 or
    1); '.1f' when any reaches 100; else '.3f'."""
    nums = [v for v in values if _is_num(v) and not _missing(v) and math.isfinite(float(v))]
    if nums and all(isinstance(v, int | np.integer) for v in nums):
        return "d"
    if nums and all(float(v).is_integer() for v in nums) and any(abs(float(v)) >= 2 for v in nums):
        return "d"
    return ".1f" if any(abs(float(v)) >= 100 for v in nums) else ".3f"


def fmt(v: object, spec: str | None = None) -> str:
    """A table cell's text: '' for missing, yes/'' for bools, numbers in `spec` (number_format([v]) if None)."""
    if _missing(v):
        return ""
    if isinstance(v, bool | np.bool_):
        return "yes" if v else ""
    if _is_num(v):
        x = float(v)
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        spec = spec or number_format([v])
        return str(int(x)) if spec == "d" else format(x, spec)
    return str(v)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool | np.bool_)


def code_spans(text: str) -> str:
    """Escaped text with its `backtick` spans as <code> (the tables' .md banners, shown as HTML)."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", esc(text))


def header(name: str) -> str:
    """An escaped header that may wrap after '_' (long metric names otherwise force wide columns)."""
    return esc(name).replace("_", "_<wbr>")


def table(
    df: pd.DataFrame,
    links: dict[str, str] | None = None,
    raw_columns: Sequence[str] = (),
    numbers_by: str = "column",
) -> str:
    """A real HTML table inside a horizontally scrolling container; cells escaped, numbers right-aligned.

    links: run_id -> href; cells of a run_id column become links. raw_columns hold trusted HTML (built here).
    numbers_by: "column" or "row": the group of cells that share one number format (rows for tables whose
    rows are metrics).
    """
    links = links or {}
    head = "".join(f"<th>{header(str(c))}</th>" for c in df.columns)
    specs = {c: number_format(df[c].tolist()) for c in df.columns}
    body = []
    for rec in df.itertuples(index=False):
        row_spec = number_format(rec) if numbers_by == "row" else None
        cells = []
        for col, v in zip(df.columns, rec):
            text = fmt(v, row_spec or specs[col])
            if col in raw_columns:
                cells.append(f"<td>{v}</td>")
            elif col == "run_id" and text in links:
                cells.append(f'<td><a href="{esc(links[text])}">{esc(text)}</a></td>')
            else:
                cells.append(f'<td class="n">{esc(text)}</td>' if _is_num(v) else f"<td>{esc(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<div class="tw"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
    )


def kv_table(pairs: Sequence[tuple[str, object]]) -> str:
    """A two-column key / value table."""
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(fmt(v))}</td></tr>" for k, v in pairs)
    return f'<div class="tw"><table class="kv"><tbody>{rows}</tbody></table></div>'


def figure(data: bytes, alt: str) -> str:
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}">'


def page(title: str, body: Sequence[str]) -> str:
    head = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>"
    )
    return head + "\n" + "\n".join(body) + "\n</body></html>\n"


def duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "not logged"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


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


def train_seconds(metrics: pd.DataFrame) -> pd.Series:
    """Sum of step_time per run (train split, role all): the time inside training steps, evals excluded."""
    t = step_time_table(metrics)
    return t.groupby("run_id")["step_time"].sum()


def eval_time_text(metrics: pd.DataFrame, train_s: float) -> str:
    """Total evaluation time and its share of training plus evaluation (runs that log `time_eval`)."""
    t = metrics[
        (metrics["split"] == "eval") & (metrics["role"] == "all") & (metrics["metric"] == "time_eval")
    ]
    if t.empty:
        return "not logged"
    ev = float(t["value"].sum())
    return f"{duration(ev)} total, {ev / (ev + train_s):.0%} of training plus evaluation"


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


# ---------------------------------------------------------------------------- findings

SHOWN = 3  # most runs named per finding (cliffs, failures); the full lists are in the sections below
SHOWN_CELLS = 6  # most SP - IP cells, the largest peak differences first (the box must fit the first screen)
# Short names of the headline peak estimates (tables.PEAK_ESTIMATES) in the findings box.
PEAK_NAMES = {"peak_heldout": "held-out peak", "peak_confirmed": "cross-fitted peak"}


def with_peak_se(summary: pd.DataFrame, metrics: pd.DataFrame) -> pd.DataFrame:
    """summary plus `peak_se`: the standard error of the test evaluation at the held-out peak step
    (peak_heldout_step; accuracy_se as logged, else sqrt(p (1 - p) / n)), NaN where the run has none. The
    in-sample peak's `se` is never used for it: its step was selected on the test problems."""
    recs = []
    for rid, g in eval_curves(metrics).groupby("run_id", sort=False):
        g, n = g.reset_index(drop=True), eval_sizes(g)
        recs += [(rid, int(g["step"].iloc[i]), peak_se(g, i, float(n[i]))) for i in range(len(g))]
    at = pd.DataFrame(recs, columns=["run_id", "peak_heldout_step", "peak_se"])
    at["peak_heldout_step"] = at["peak_heldout_step"].astype("Int64")
    out = summary.drop(columns=["peak_se"], errors="ignore").copy()
    out["peak_heldout_step"] = out["peak_heldout_step"].astype("Int64")
    return out.merge(at, on=["run_id", "peak_heldout_step"], how="left")


def _spread(values: pd.Series) -> str:
    """'0.600' for one seed, else 'mean (min-max)' over the seeds (a range: with 2-3 seeds a t-interval is
    wider than the accuracy scale; the CIs are in Summary by cell)."""
    v = values.astype(float).dropna()
    if v.empty:
        return "not logged"
    if len(v) == 1:
        return f"{v.iloc[0]:.3f}"
    return f"{v.mean():.3f} ({v.min():.3f}-{v.max():.3f})"


def replicate_word(df: pd.DataFrame) -> str:
    """What one replicate of `df`'s cells is called: "seeds", or "replicates (seeds x builds)" where the
    rows carry more than one toy build (marlflow.analysis.seeds.replicate_keys: a replicate is a (seed, build)
    pair, so counting them as seeds would overstate the seeds)."""
    builds = df["build"].nunique() if "build" in df.columns else 1
    return "replicates (seeds x builds)" if builds > 1 else "seeds"


def _seeds(g: pd.DataFrame) -> str:
    """'one seed', or 'range over N seeds' / 'range over N replicates (seeds x builds)' for a cell's rows."""
    n, word = n_replicates(g), replicate_word(g)
    if n == 1:
        return "one seed" if word == "seeds" else "one replicate"
    return f"range over {n} {word}"


def _more(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _cell_text(cell: dict, g: pd.DataFrame, peak: str) -> str:
    step = ""
    if peak == "peak_heldout":
        steps = ", ".join(str(int(x)) for x in sorted(g["peak_heldout_step"].dropna()))
        step = f" (step {steps or '?'})"
    return (
        f"{cell_label(cell)}: base {_spread(g['base'])}, {PEAK_NAMES[peak]} {_spread(g[peak])}{step}, "
        f"terminal {_spread(g['terminal'])} ({_seeds(g)})"
    )


def best_worst(summary: pd.DataFrame) -> list[tuple[str, str]]:
    """(label, text): the cell with the largest mean peak - base and the one with the smallest terminal - base
    (mean over its replicates), each with its base, peak, peak step and terminal (last eval). The peak is the
    headline estimate (tables.peak_estimate: held-out, else cross-fitted), never the in-sample max."""
    s = summary[summary["n_evals"] > 0]
    groups = [(dict(zip(CELL_KEYS, k)), g) for k, g in s.groupby(CELL_KEYS, sort=True)]
    if not groups:
        return [("Cells", "no run has an eval accuracy")]
    peak = peak_estimate(s)
    gain = PEAK_ESTIMATES[peak][0]
    best = max(groups, key=lambda kg: (kg[1][gain].mean(), cell_label(kg[0])))
    worst = min(groups, key=lambda kg: (kg[1]["gain_terminal"].mean(), cell_label(kg[0])))
    out = [(f"Largest gain ({PEAK_NAMES[peak]} - base)", _cell_text(*best, peak))]
    if worst[0] != best[0]:
        out.append(("Smallest terminal gain (terminal - base)", _cell_text(*worst, peak)))
    return out


def sp_ip_lines(con: pd.DataFrame | None, summary: pd.DataFrame) -> list[str]:
    """Per workflow x scale x task (x intervention) with both SP and IP runs: the replicate-paired SP - IP
    difference of the headline peak (tables.peak_estimate: held-out, else cross-fitted; never the in-sample
    max) and of terminal_mean3 (contrasts.csv). Over >= 2 pairs with its 95% CI and which side it favours;
    over one pair with the evaluation noise of such a difference, 2 x sqrt(se_SP^2 + se_IP^2) (se: the
    standard error of the test evaluation at each run's held-out peak step, `peak_se` from with_peak_se;
    unknown without it)."""
    if con is None:
        return ["contrasts.csv is missing: rerun <code>python -m marlflow aggregate</code>"]
    peak = peak_estimate(summary)
    c = con[(con["contrast"] == "sp-ip") & con["stat"].isin([peak, "terminal_mean3"])]
    out = []
    for key, g in _cell_order(c).groupby(CELL_KEYS, sort=False, dropna=False):
        cell = dict(zip(CELL_KEYS, key))
        by = {r["stat"]: r for r in g.to_dict("records")}
        if peak not in by or _missing(by[peak]["mean"]):
            continue
        pairs = int(by[peak]["n_pairs"])
        parts = []
        for stat, name in ((peak, PEAK_NAMES[peak]), ("terminal_mean3", "terminal")):
            r = by.get(stat)
            if r is None or _missing(r["mean"]):
                continue
            text = f"{name} {float(r['mean']):+.3f}"
            if pairs >= 2 and not _missing(r["lo"]):
                lo, hi = float(r["lo"]), float(r["hi"])
                side = "SP higher" if lo > 0 else "IP higher" if hi < 0 else "no clear difference"
                text += f" [{lo:+.3f}, {hi:+.3f}]: {side}"
            parts.append(text)
        label = cell_label(cell, sharing=False)
        if pairs >= 2:
            out.append(
                (
                    abs(float(by[peak]["mean"])),
                    f"{esc(label)}: {esc('; '.join(parts))} ({pairs} seed pairs)",
                )
            )
            continue
        same = (
            summary[["workflow", "scale", "task", "intervention"]] == [key[0], key[2], key[3], key[4]]
        ).all(1)
        se = summary.loc[same, "peak_se"].astype(float) if "peak_se" in summary.columns else pd.Series([])
        noise = 2 * math.sqrt(float((se**2).sum())) if len(se) == 2 and se.notna().all() else math.nan
        side = float(by[peak]["mean"])
        if math.isfinite(noise):
            verdict = (
                f"peaks within eval noise ({noise:.3f})"
                if abs(side) <= noise
                else f"{'SP' if side > 0 else 'IP'} peak higher by more than the eval noise ({noise:.3f})"
            )
        else:
            verdict = "eval noise unknown (no SE at the held-out peak for exactly one SP and one IP run)"
        out.append((abs(side), f"{esc(label)}: {esc(', '.join(parts))}: {esc(verdict)}"))
    if not out:
        return ["no cell has both an SP and an IP run"]
    shown = [text for _, text in sorted(out, key=lambda x: -x[0])[:SHOWN_CELLS]]
    if len(out) > SHOWN_CELLS:
        shown.append(
            f"{len(out) - SHOWN_CELLS} more cells with smaller peak differences: Paired SP - IP below"
        )
    return shown


def cliff_lines(summary: pd.DataFrame) -> str:
    """How many runs end in a terminal cliff, and the largest drops: the cliff test's drop with its SE
    (definitions: a calibrated test over the candidate peaks, not a selected peak) and the held-out peak with
    its step (never the in-sample max), then terminal_mean3."""
    s = summary[summary["n_evals"] > 0]
    cl = s[s["cliff"].astype(bool)].sort_values(["drop", "run_id"], ascending=[False, True])
    if cl.empty:
        return f"no terminal cliff in {len(s)} runs"

    def held(r) -> str:
        if _missing(r.get("peak_heldout")):
            return "no held-out peak"
        return f"held-out peak {float(r['peak_heldout']):.3f} at step {int(r['peak_heldout_step'])}"

    shown = [
        f"{r['run_id']} (drop {float(r['drop']):.3f}, SE {float(r['drop_se']):.3f}; {held(r)} -> "
        f"{float(r['terminal_mean3']):.3f} over the last 3 evals)"
        for r in cl.head(SHOWN).to_dict("records")
    ]
    more = f" and {len(cl) - SHOWN} more" if len(cl) > SHOWN else ""
    return f"{len(cl)} of {len(s)} runs: " + "; ".join(shown) + more


def format_rises(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per run x role with eval format_failure_rate: the first and the last logged value and their steps,
    rows whose rise (last - first) is >= FORMAT_RISE (the capture rule's size), largest rise first."""
    cols = ["run_id", "role", "first_step", "first", "last_step", "last", "rise"]
    f = wide(metrics, "eval", None, ["format_failure_rate"])
    f = f[(f["role"] != "all") & f["format_failure_rate"].notna()].sort_values("step")
    recs = []
    for (rid, role), g in f.groupby(["run_id", "role"], sort=True):
        a, b = g.iloc[0], g.iloc[-1]
        rise = float(b["format_failure_rate"]) - float(a["format_failure_rate"])
        recs.append([rid, role, int(a["step"]), float(a["format_failure_rate"]), int(b["step"]),
                     float(b["format_failure_rate"]), rise])  # fmt: skip
    out = pd.DataFrame(recs, columns=cols)
    out = out[out["rise"] >= FORMAT_RISE - 1e-9]
    return out.sort_values(["rise", "run_id"], ascending=[False, True], kind="stable").reset_index(drop=True)


def failure_lines(failures: pd.DataFrame, metrics: pd.DataFrame) -> list[str]:
    """Counts of collapse / stagnation / capture (failures.csv) with the runs, and the largest rises of a
    role's format-failure rate (the metrics), with values and steps."""
    flags = failure_flags(failures)
    out = []
    for sig in ("collapse", "stagnation", "capture"):
        runs = [rid for rid, f in flags.items() if sig in f]
        if runs:
            out.append(esc(f"{sig}: {len(runs)} of {len(flags)} runs ({_more(runs)})"))
    rises = format_rises(metrics)
    for r in rises.head(SHOWN).to_dict("records"):
        out.append(esc(f"{r['run_id']}: the {r['role']}'s format-failure rate rises {r['first']:.2f} (step "
                       f"{r['first_step']}) -> {r['last']:.2f} (step {r['last_step']})"))  # fmt: skip
    if len(rises) > SHOWN:
        out.append(
            esc(f"and {len(rises) - SHOWN} more roles whose format-failure rate rises by >= {FORMAT_RISE}")
        )
    return out or [esc(f"no collapse, stagnation, capture or format-failure rise in {len(flags)} runs")]


def band_warning(summary: pd.DataFrame) -> str | None:
    """The toy runs whose base (step-0 accuracy) is outside TOY_BASE_BAND, as a sentence; None if all inside."""
    lo, hi = TOY_BASE_BAND
    toy = summary[(summary["scale"] == "toy") & summary["base"].notna()]
    out = toy[(toy["base"] < lo - 1e-9) | (toy["base"] > hi + 1e-9)].sort_values("run_id")
    if out.empty:
        return None
    runs = [f"{r['run_id']} {float(r['base']):.3f}" for r in out.to_dict("records")]
    return (
        f"{len(out)} of {len(toy)} toy bases are outside the designed band [{lo:.2f}, {hi:.2f}] ({_more(runs)}): "
        "the toy model or machine is not the one the README's numbers come from (weights hash and CPU under "
        "Provenance); expect other numbers."
    )


def findings_section(tables: dict[str, object], metrics: pd.DataFrame) -> list[str]:
    """The box at the top of the overview: seeds banner, best and worst cells, SP vs IP, cliffs, failures."""
    summary = with_peak_se(tables["summary"], metrics)
    s = summary[summary["n_evals"] > 0]
    per_cell = s.groupby(CELL_KEYS).apply(n_replicates, include_groups=False) if len(s) else pd.Series([])
    items = []
    if len(per_cell) and one_seed(s):
        head = f"<p class='banner'>{code_spans(ONE_SEED_BANNER)}</p>"
    elif len(per_cell) and per_cell.min() < 5:
        k, n = int(per_cell.min()), int(per_cell.max())
        word = replicate_word(s)
        head = (f"<p class='banner'>{k if k == n else f'{k}-{n}'} {word} per cell: read differences as "
                f"indications; intervals over so few {word.split()[0]} are wide.</p>")  # fmt: skip
    else:
        head = ""
    warn = band_warning(summary)
    if warn:
        items.append(f"<li class='warn'>{esc(warn)}</li>")
    items += [f"<li><b>{esc(k)}</b>: {esc(v)}</li>" for k, v in best_worst(summary)]
    sp_ip = sp_ip_lines(tables.get("contrasts.csv"), summary)
    how = (
        "one seed pair each, so no CI; eval noise = 2 x the SE of the two test evals at the held-out peaks"
        if one_seed(s)
        else "mean over seed pairs [95% CI]"
    )
    peak = PEAK_NAMES[peak_estimate(s)] if len(s) else "peak"
    items.append(
        f"<li><b>SP - IP</b> ({peak}; terminal = mean of the last 3 evals; {how}):<ul>"
        + "".join(f"<li>{x}</li>" for x in sp_ip)
        + "</ul></li>"
    )
    items.append(f"<li><b>Terminal cliffs</b>: {esc(cliff_lines(summary))}</li>")
    fails = failure_lines(tables["failures"], metrics)
    items.append(
        "<li><b>Failure signatures</b>:<ul>" + "".join(f"<li>{x}</li>" for x in fails) + "</ul></li>"
    )
    return [
        "<section id='findings' class='findings'><h2>Findings</h2>",
        head,
        f"<ul>{''.join(items)}</ul>",
        "<p class='note'>From summary.parquet, contrasts.csv, failures.csv and the runs' metrics; details in the "
        "sections below.</p></section>",
    ]


# Instruction sets that decide which CPU kernels torch/oneDNN run, highest first (and so the toy model's
# rounding: marlflow.models.toybuild, "Determinism"), as /proc/cpuinfo flag -> name.
CPU_FEATURES = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16", "avx512f": "AVX512", "avx2": "AVX2"}


def cpu_text(model: str, flags: Sequence[str]) -> str:
    """'Intel(R) Xeon(R) Processor (AMX, AVX512-BF16, AVX512, AVX2)' from a CPU model and its flags."""
    have = [name for flag, name in CPU_FEATURES.items() if flag in set(flags)]
    return f"{model or 'unknown CPU'} ({', '.join(have) or 'no AVX2'})"


def machine_provenance(run_info: dict[str, dict]) -> list[tuple[str, str]]:
    """Where the runs trained: one line per distinct environment their environment.jsonl records
    (marlflow.training.environment: CPU and its kernels, torch, GPU, hosts); for runs that recorded none (trained before
    it existed) the CPU, kernels and torch of the machine the report is built on (toybuild.cpu_info)."""
    import torch

    from marlflow.models.toybuild import cpu_info  # imports torch: only when a report is built

    envs, unrecorded = environment.distinct(
        {rid: i["folder"] for rid, i in run_info.items() if i.get("folder") is not None}
    )
    unrecorded += [rid for rid, i in run_info.items() if i.get("folder") is None]
    out = []
    for e in envs:
        gpu = f"; GPU {e['cuda_device']}" if e.get("cuda_device") else ""
        out.append((
            f"CPU where {len(e['runs'])} of {len(run_info)} runs trained (environment.jsonl)",
            f"{cpu_text(e['cpu_model'], e['cpu_flags'])}; torch kernels: {e['torch_cpu_capability']}; "
            f"torch {e['torch']}{gpu}; {e['torch_threads']} torch thread(s); hosts {', '.join(e['hosts'])}",
        ))  # fmt: skip
    if unrecorded or not envs:  # the runs' own machine only if the matrix ran where the report is built
        info = cpu_info()
        out += [
            ("CPU (where the report was built)", cpu_text(info["cpu_model"], info["cpu_flags"])
             + f"; torch kernels: {torch.backends.cpu.get_cpu_capability()}"),
            ("torch (where the report was built)", torch.__version__),
        ]  # fmt: skip
        if envs:
            out.append(("runs that recorded no environment.jsonl", ", ".join(sorted(unrecorded))))
    return out


def toy_model_provenance(run_info: dict[str, dict]) -> list[tuple[str, str]]:
    """Per toy model the runs used (config.json `model`, a folder with warmstart.json): its weights_sha256,
    the CPU, torch version and threads it was built with, and whether it is the model marlflow ships."""
    from marlflow.models.loading import SHIPPED_TOY

    shipped = _read_json(SHIPPED_TOY / "warmstart.json").get("weights_sha256")
    folders = sorted({str(i["config"]["model"]) for i in run_info.values()
                      if i["config"].get("scale") == "toy" and i["config"].get("model")})  # fmt: skip
    out = []
    for folder in folders:
        ws = _read_json(Path(folder) / "warmstart.json")
        h = ws.get("weights_sha256")
        if not h:
            out.append(
                (f"toy model {folder}", "no warmstart.json with weights_sha256 there (moved or deleted)")
            )
            continue
        same = (
            "the model marlflow ships" if h == shipped
            else f"not the shipped model ({str(shipped)[:16]}...): rebuilt, so its numbers can differ"
        )  # fmt: skip
        out.append((
            f"toy model {folder}",
            f"weights_sha256 {h}, {same}; built on {cpu_text(ws.get('cpu_model', ''), ws.get('cpu_flags', []))}"
            f" with torch {ws.get('torch', '?')}, {ws.get('threads', '?')} threads",
        ))  # fmt: skip
    return out


def provenance_section(
    run_info: dict[str, dict], metrics: pd.DataFrame, commit: str, summary: pd.DataFrame
) -> list[str]:
    cfgs = [i["config"] for i in run_info.values() if i["config"]]
    threads = sorted({str(c["threads"]) for c in cfgs if c.get("threads") is not None}, key=int)
    presets = sorted({str(c.get("preset")) for c in cfgs if c.get("preset")})
    models = sorted({f"{c.get('scale')}: {c.get('model')}" for c in cfgs if c.get("model")})
    secs = train_seconds(metrics)
    steps = wide(metrics, "train", "all", ["step_time"]).groupby("run_id")["step"].max()
    pairs = [
        ("preset", ", ".join(presets) or "unknown (no config.json beside the metrics)"),
        ("runs", metrics["run_id"].nunique()),
        ("train steps per run", ", ".join(sorted({str(int(s)) for s in steps})) or "not logged"),
        ("models", "; ".join(models) or "unknown"),
        ("git commit (when the report was built)", commit),
        (
            "training wall time (sum of step_time over runs; evals and model loading excluded)",
            f"{duration(float(secs.sum()))} total; per run {duration(float(secs.min()))} to "
            f"{duration(float(secs.max()))}"
            if len(secs)
            else "not logged",
        ),
        ("evaluation wall time (sum of time_eval over runs)", eval_time_text(metrics, float(secs.sum()))),
        *machine_provenance(run_info),
        ("torch threads per run (config.json)", ", ".join(threads) or "unknown"),
        *toy_model_provenance(run_info),
    ]
    if (summary["scale"] == "toy").any():
        lo, hi = TOY_BASE_BAND
        n = int(summary["base"][summary["scale"] == "toy"].notna().sum())
        pairs.append(
            (f"toy bases in the designed band [{lo:.2f}, {hi:.2f}]", band_warning(summary) or f"all {n}")
        )
    versions = ", ".join(f"{k} {v}" for k, v in package_versions().items())
    return ["<h2 id='provenance'>Provenance</h2>", kv_table([*pairs, ("package versions", versions)])]


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
    if _missing(m):
        return ""
    text = f"{float(m):+.3f}" if signed else f"{float(m):.3f}"
    if not na and (_missing(lo) or _missing(hi)):
        return esc(text)
    ci = "n/a" if _missing(lo) or _missing(hi) else f"[{float(lo):.3f}, {float(hi):.3f}]"
    return f"{esc(text)}<br><span class='ci'>{esc(ci)}</span>"


def cell_label(rec: dict, sharing: bool = True) -> str:
    """'voting-ip toy math' (+intervention) for a cell's key columns."""
    head = f"{rec['workflow']}-{rec['sharing']}" if sharing else str(rec["workflow"])
    label = f"{head} {rec['scale']} {rec['task']}"
    itv = rec.get("intervention")
    return label if itv in ("none", "", None) or _missing(itv) else f"{label} +{itv}"


def _cell_order(df: pd.DataFrame) -> pd.DataFrame:
    wf, sh, sc, tk = (order_key(o) for o in (WORKFLOW_ORDER, SHARING_ORDER, SCALE_ORDER, TASK_ORDER))
    keys = df.apply(lambda r: (wf(r["workflow"]), sc(r["scale"]), tk(r["task"]), str(r["intervention"]),
                               sh(r["sharing"])), axis=1)  # fmt: skip
    return df.assign(_k=keys).sort_values("_k", kind="stable").drop(columns="_k").reset_index(drop=True)


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
    _need(con, "contrasts.csv", ["contrast", *CELL_KEYS, "stat", "n_pairs", "mean", "lo", "hi"])
    c = con[con["contrast"] == kind]
    if c.empty:
        return f"<p class='note'>No {esc(kind)} pairs among these runs.</p>"
    single = one_seed(con)
    stats = [
        st for st in dict.fromkeys(c["stat"]) if not single or c.loc[c["stat"] == st, "mean"].notna().any()
    ]
    recs = []
    for key, g in _cell_order(c).groupby(CELL_KEYS, sort=False, dropna=False):
        rec = dict(zip(CELL_KEYS, key))
        by = {r["stat"]: r for r in g.to_dict("records")}
        row = {"cell": cell_label(rec, sharing=kind != "sp-ip"), "seed pairs": int(g["n_pairs"].max())}
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
            "verdict": "" if _missing(r["verdict"]) else r["verdict"],
        }
        for r in itv.to_dict("records")
    ]
    return [
        "<h3 id='pooled_interventions'>Pooled over cells and replicates</h3>",
        "<p class='note'>Each intervention minus the baseline, paired within cell and replicate and pooled, as "
        "the preset declares it in matrix.yaml (analysis.interventions; interventions.md says what was declared, "
        "or that nothing was). Intervals at the corrected level shown; cliff: Newcombe's paired interval; the "
        "verdict is on the declared statistic only. From interventions.csv.</p>",
        table(pd.DataFrame(recs), raw_columns=("difference",)),
    ]


def contrasts_section(con: pd.DataFrame | None, itv: pd.DataFrame | None = None) -> list[str]:
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
        ]
    return out


def cells_section(cells: pd.DataFrame | None) -> list[str]:
    out = ["<h2 id='cells'>Summary by cell</h2>"]
    if cells is None:
        return [*out, f"<p class='note'>{MISSING_TABLE.format(name='summary_by_cell.csv')}</p>"]
    _need(cells, "summary_by_cell.csv", [*CELL_KEYS, "n_seeds"])
    single = one_seed(cells)
    stats = [c.removesuffix("_mean") for c in cells.columns if c.endswith("_mean")]
    stats = [st for st in stats if not single or cells[f"{st}_mean"].notna().any()]
    recs = []
    for rec in _cell_order(cells).to_dict("records"):
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


def failure_flags(failures: pd.DataFrame) -> dict[str, list[str]]:
    flags = {}
    for rec in failures.to_dict("records"):
        flags[str(rec["run_id"])] = [
            k for k in ("cliff", "collapse", "stagnation", "capture") if str(rec.get(k)).lower() == "true"
        ]
    return flags


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
        *contrasts_section(tables.get("contrasts.csv"), tables.get("interventions.csv")),
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


# ---------------------------------------------------------------------------- run pages


def per_role_train(metrics: pd.DataFrame) -> pd.DataFrame:
    """role x metric over train steps: first, early (first third mean), late (last third mean), last."""
    tr = metrics[metrics["split"] == "train"]
    recs = []
    roles = sorted(tr["role"].unique(), key=lambda r: (r == "all", r))
    for role in roles:
        for name, g in tr[tr["role"] == role].groupby("metric", sort=True):
            v = g.sort_values("step")["value"].dropna().to_numpy(float)
            if not len(v):
                continue
            k = math.ceil(len(v) / 3)
            recs.append({"role": role, "metric": name, "first": v[0], "early_mean": v[:k].mean(),
                         "late_mean": v[-k:].mean(), "last": v[-1]})  # fmt: skip
    return pd.DataFrame(recs, columns=["role", "metric", "first", "early_mean", "late_mean", "last"])


def per_step_eval(metrics: pd.DataFrame) -> pd.DataFrame:
    """Eval metrics as rows (role, metric) and one column per eval step."""
    ev = metrics[metrics["split"] == "eval"]
    if ev.empty:
        return pd.DataFrame()
    t = ev.pivot_table(index=["role", "metric"], columns="step", values="value", aggfunc="last")
    t.columns = [f"step {c}" for c in t.columns]
    t = t.reset_index()
    t["_o"] = t["role"] != "all"
    return t.sort_values(["_o", "role", "metric"]).drop(columns="_o").reset_index(drop=True)


def step_time_split(metrics: pd.DataFrame) -> pd.DataFrame:
    t = step_time_table(metrics)
    total = float(t["step_time"].sum())
    recs = [{"part": "step_time (all)", "total_s": total, "share": 1.0 if total > 0 else math.nan,
             "mean_per_step_s": float(t["step_time"].mean())}]  # fmt: skip
    for part in TIME_PARTS:
        s = float(t[part].sum())
        recs.append({"part": part, "total_s": s, "share": s / total if total > 0 else math.nan,
                     "mean_per_step_s": float(t[part].mean())})  # fmt: skip
    return pd.DataFrame(recs)


def transcripts(samples: pd.DataFrame | None) -> list[str]:
    if samples is None:
        return ["<p class='note'>No samples.parquet beside this run's metrics.</p>"]
    if samples.empty:
        return ["<p class='note'>samples.parquet has no rows for this run.</p>"]
    out = ["<p class='note'>Eval episodes logged at each evaluation (samples.parquet), every role call in "
           f"order. Prompts are folded; texts over {TRANSCRIPT_CHARS} characters are cut.</p>"]  # fmt: skip
    steps = sorted(samples["step"].unique())
    for step in steps:
        s = samples[samples["step"] == step]
        eps = s.groupby("episode", sort=True)
        rewards = [float(g["reward"].iloc[0]) for _, g in eps]
        opened = " open" if step == steps[-1] else ""
        out.append(
            f"<details{opened}><summary><b>step {int(step)}</b>: {len(rewards)} episodes, mean reward "
            f"{np.mean(rewards):.2f}</summary>"
        )
        for ep, g in eps:
            reward = float(g["reward"].iloc[0])
            cls = "ok" if reward > 0 else "bad"
            out.append(f"<h3>episode {int(ep)} · problem {esc(g['uid'].iloc[0])} · "
                       f"<span class='{cls}'>reward {reward:.2f}</span></h3>")  # fmt: skip
            for rec in g.to_dict("records"):
                ff = " · <span class='bad'>format failure</span>" if bool(rec["format_failure"]) else ""
                out.append(
                    f"<div class='call'><b>{esc(rec['slot'])}</b> ({esc(rec['role'])}){ff}"
                    f"<details><summary>prompt</summary><pre>{esc(_cut(rec['prompt']))}</pre></details>"
                    f"<pre>{esc(_cut(rec['output']))}</pre></div>"
                )
        out.append("</details>")
    return out


def _cut(text: object) -> str:
    t = "" if text is None else str(text)
    return (
        t
        if len(t) <= TRANSCRIPT_CHARS
        else t[:TRANSCRIPT_CHARS] + f" [... {len(t) - TRANSCRIPT_CHARS} chars cut]"
    )


def flat_config(cfg: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k in sorted(cfg):
        v = cfg[k]
        if isinstance(v, dict):
            out += flat_config(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", json.dumps(v) if isinstance(v, list | bool) or v is None else v))
    return out


def render_run_page(
    rid: str,
    m: pd.DataFrame,
    info: dict,
    summary_row: dict | None,
    failure: dict | None,
    overview_href: str,
    nav: tuple[str | None, str | None],
    solution: Sequence[str] = (),
) -> str:
    """One run's page; `m` holds that run's metrics rows only; `solution`: its task's solution metrics."""
    fac = m[FACTOR_COLUMNS].iloc[0].to_dict()
    prev_href, next_href = nav
    links = [f"<a href='{esc(overview_href)}'>overview</a>"]
    if prev_href:
        links.append(f"<a href='{esc(prev_href)}'>previous run</a>")
    if next_href:
        links.append(f"<a href='{esc(next_href)}'>next run</a>")
    links += [f"<a href='#{a}'>{t}</a>" for a, t in (("curves", "curves"), ("roles", "per-role metrics"),
              ("time", "step time"), ("transcripts", "transcripts"))]  # fmt: skip
    t = step_time_table(m)
    facts = [(k, fac[k]) for k in FACTOR_COLUMNS[1:]]
    if summary_row:
        facts += [
            (k, summary_row[k])
            for k in ("base", "peak_heldout", "peak_heldout_step", "terminal", "gain_heldout")
        ]
        facts += [
            ("peak_confirmed (cross-fitted)", summary_row["peak_confirmed"]),
            ("peak (in-sample: the max over the test evals, optimistic)", summary_row["peak"]),
            ("peak_step (in-sample)", summary_row["peak_step"]),
        ]
    facts.append(("train steps logged", len(t)))
    facts.append(("training wall time (sum of step_time)", duration(float(t["step_time"].sum())) if len(t)
                  else "not logged"))  # fmt: skip
    if failure:
        facts.append(("failure evidence", failure.get("evidence") or "none"))
    if info["done"]:
        facts.append(("DONE", json.dumps(info["done"], sort_keys=True)))
    curves = eval_curves(m)
    body = [
        f"<h1>{esc(rid)}</h1>",
        "<nav>" + "".join(links) + "</nav>",
        "<h2 id='facts'>Run</h2>",
        kv_table(facts),
    ]
    if info["config"]:
        body += [
            "<details><summary>config.json</summary>",
            kv_table(flat_config(info["config"])),
            "</details>",
        ]
    body += [
        "<h2 id='curves'>Curves</h2>",
        "<p class='note'>Shaded: +- 1 standard error of the evaluation.</p>",
        figure(png_bytes(plot_run(m, solution)), f"{rid} curves"),
    ]
    if not curves.empty:
        c = curves.sort_values("step").assign(se=lambda d: with_se(d))
        body.append(table(c[["step", "accuracy", "se", "n_eval"]]))
    body += [
        "<h2 id='roles'>Per-role metrics</h2>",
        "<h3>Eval, per evaluation step</h3>",
        table(per_step_eval(m), numbers_by="row"),
        "<h3>Train, over the run's steps</h3>",
        f"<p class='note'>Over the {len(t)} logged train steps; early_mean / late_mean: mean over the first / "
        "last third of the steps at which the metric is logged.</p>",
        table(per_role_train(m), numbers_by="row"),
        "<h2 id='time'>Step-time split</h2>",
    ]
    if len(t):
        body += [figure(png_bytes(plot_step_time(m)), f"{rid} step time"), table(step_time_split(m))]
    else:
        body.append("<p class='note'>No step_time rows logged.</p>")
    body += ["<h2 id='transcripts'>Sample transcripts by step</h2>", *transcripts(info["samples"])]
    return page(f"marlflow run {rid}", body)


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
