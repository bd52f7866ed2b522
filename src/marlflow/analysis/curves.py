"""Eval curves and the per-run summary: base, peak, terminal, gains, standard error and the cliff flag.

    curves = eval_curves(metrics)       # one row per run x eval step
    summary = summarize_runs(metrics)   # one row per run (SUMMARY_COLUMNS)

Definitions (see definitions.DEFINITIONS): base = accuracy at step 0; peak = max accuracy, peak_step = first
step reaching it; terminal = last eval; terminal_mean3 = mean of the last 3 evals; gain_peak = peak - base;
gain_terminal = terminal - base; se = standard error of one evaluation at peak_step (accuracy_se row, else
sqrt(p(1-p)/n_eval)); cliff = peak - terminal >= max(0.05, 2 se).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from marlflow.analysis.definitions import TOL, threshold
from marlflow.metrics import FACTOR_COLUMNS

CURVE_COLUMNS = [*FACTOR_COLUMNS, "step", "accuracy", "accuracy_se", "n_eval"]
SUMMARY_COLUMNS = [
    *FACTOR_COLUMNS,
    "base",
    "peak",
    "peak_step",
    "terminal",
    "terminal_mean3",
    "gain_peak",
    "gain_terminal",
    "se",
    "cliff",
    "n_evals",
]


def run_factors(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row of factor columns per run, sorted by run_id."""
    f = metrics[FACTOR_COLUMNS].drop_duplicates("run_id")
    return f.sort_values("run_id").reset_index(drop=True)


def wide(metrics: pd.DataFrame, split: str, role: str | None, names: list[str]) -> pd.DataFrame:
    """Metrics rows of one split (and role, unless None) pivoted to one column per metric name.

    Index columns: factors, step (and role when `role` is None); absent metrics are NaN columns.
    """
    sel = metrics[(metrics["split"] == split) & metrics["metric"].isin(names)]
    keys = [*FACTOR_COLUMNS, "step"]
    if role is None:
        keys.append("role")
    else:
        sel = sel[sel["role"] == role]
    sel = sel.drop_duplicates([*keys, "metric"], keep="last")
    out = sel.pivot(index=keys, columns="metric", values="value")
    out = out.reindex(columns=names).reset_index()
    out.columns.name = None
    return out.sort_values(["run_id", "step", *(["role"] if role is None else [])]).reset_index(drop=True)


def eval_curves(metrics: pd.DataFrame) -> pd.DataFrame:
    """Workflow eval accuracy per run x step (eval split, role "all"), with accuracy_se and n_eval (NaN if absent).

    Steps without an accuracy value are dropped.
    """
    out = wide(metrics, "eval", "all", ["accuracy", "accuracy_se", "n_eval"])
    out = out[out["accuracy"].notna()]
    return out[CURVE_COLUMNS].reset_index(drop=True)


def peak_se(curve: pd.DataFrame, i: int) -> float:
    """Standard error of the evaluation in row `i` of one run's curve (see module docstring); NaN if unknown."""
    row = curve.iloc[i]
    if pd.notna(row["accuracy_se"]):
        return float(row["accuracy_se"])
    n = row["n_eval"]
    if pd.isna(n):
        ns = curve["n_eval"].dropna()
        n = float(ns.median()) if len(ns) else math.nan
    if not (n > 0):
        return math.nan
    p = float(row["accuracy"])
    return math.sqrt(max(p * (1.0 - p), 0.0) / n)


def summarize_curve(curve: pd.DataFrame) -> dict:
    """Summary numbers of one run's eval curve (rows of eval_curves for one run)."""
    c = curve.sort_values("step").reset_index(drop=True)
    if c.empty:
        nan = math.nan
        return dict(base=nan, peak=nan, peak_step=pd.NA, terminal=nan, terminal_mean3=nan, gain_peak=nan,
                    gain_terminal=nan, se=nan, cliff=False, n_evals=0)  # fmt: skip
    acc = c["accuracy"].to_numpy(dtype=float)
    steps = c["step"].to_numpy()
    at0 = acc[steps == 0]
    base = float(at0[0]) if len(at0) else math.nan
    i = int(np.argmax(acc))
    peak, terminal = float(acc[i]), float(acc[-1])
    se = peak_se(c, i)
    return dict(
        base=base,
        peak=peak,
        peak_step=int(steps[i]),
        terminal=terminal,
        terminal_mean3=float(acc[-3:].mean()),
        gain_peak=peak - base,
        gain_terminal=terminal - base,
        se=se,
        cliff=bool(peak - terminal >= threshold(se) - TOL),
        n_evals=len(c),
    )


def summarize_runs(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per run with SUMMARY_COLUMNS, sorted by run_id. Runs without eval accuracy get NaNs, n_evals 0."""
    curves = eval_curves(metrics)
    by_run = dict(tuple(curves.groupby("run_id", sort=True)))
    records = []
    for fac in run_factors(metrics).to_dict("records"):
        curve = by_run.get(fac["run_id"], curves.iloc[0:0])
        records.append({**fac, **summarize_curve(curve)})
    out = pd.DataFrame.from_records(records, columns=SUMMARY_COLUMNS)
    out["peak_step"] = out["peak_step"].astype("Int64")
    out["n_evals"] = out["n_evals"].astype("int64")
    out["cliff"] = out["cliff"].astype(bool)
    for c in ("base", "peak", "terminal", "terminal_mean3", "gain_peak", "gain_terminal", "se"):
        out[c] = out[c].astype("float64")
    return out
