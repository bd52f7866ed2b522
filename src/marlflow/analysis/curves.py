"""Eval curves and the per-run summary: base, peak, terminal, gains and the calibrated curve tests.

    curves = eval_curves(metrics)       # one row per run x eval step (CURVE_COLUMNS)
    summary = summarize_runs(metrics)   # one row per run (SUMMARY_COLUMNS)

Every column is defined in definitions.DEFINITIONS; the tests (cliff, collapse, stagnation, with the
cross-fitted peak_confirmed and the SE of each difference) are computed by stats.curve_tests. Runs with a
validation set (task.val_size, metrics rows split "val") also get peak_heldout: the step is selected on the
validation problems and its accuracy read on the test problems, which no selection has seen.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from marlflow.core.stats import curve_tests
from marlflow.store.schema import FACTOR_COLUMNS

HALF_COLUMNS = ["accuracy_a", "accuracy_b", "n_eval_a", "n_eval_b"]
CURVE_COLUMNS = [*FACTOR_COLUMNS, "step", "accuracy", "accuracy_se", "n_eval", *HALF_COLUMNS]
SUMMARY_COLUMNS = [
    *FACTOR_COLUMNS,
    "base",
    "peak",
    "peak_step",
    "terminal",
    "terminal_mean3",
    "peak_confirmed",
    "gain_peak",
    "gain_confirmed",
    "gain_terminal",
    "gain_terminal3",
    "se",
    "drop",
    "drop_se",
    "cliff",
    "collapse",
    "stagnation",
    "n_evals",
    "peak_heldout_step",
    "peak_heldout",
    "gain_heldout",
]
FLOAT_SUMMARY = ["base", "peak", "terminal", "terminal_mean3", "peak_confirmed", "gain_peak", "gain_confirmed",
                 "gain_terminal", "gain_terminal3", "se", "drop", "drop_se", "peak_heldout", "gain_heldout"]  # fmt: skip


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
    """Workflow eval accuracy per run x step (eval split, role "all"), with accuracy_se, n_eval and the
    half-set columns (NaN if absent). Steps without an accuracy value are dropped."""
    out = wide(metrics, "eval", "all", ["accuracy", "accuracy_se", "n_eval", *HALF_COLUMNS])
    out = out[out["accuracy"].notna()]
    return out[CURVE_COLUMNS].reset_index(drop=True)


def eval_sizes(curve: pd.DataFrame) -> np.ndarray:
    """n_eval per row; a missing one is the run's median n_eval, else p(1-p)/accuracy_se^2, else NaN."""
    n = curve["n_eval"].to_numpy(dtype=float).copy()
    known = n[np.isfinite(n)]
    if len(known):
        return np.where(np.isfinite(n), n, float(np.median(known)))
    p, se = curve["accuracy"].to_numpy(dtype=float), curve["accuracy_se"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.where((se > 0) & (p > 0) & (p < 1), np.round(p * (1 - p) / se**2), np.nan)
    known = guess[np.isfinite(guess)]
    return np.full(len(n), float(np.median(known)) if len(known) else math.nan)


def peak_se(curve: pd.DataFrame, i: int, n: float) -> float:
    """Standard error of the single evaluation in row `i` of one run's curve; NaN if unknown."""
    row = curve.iloc[i]
    if pd.notna(row["accuracy_se"]):
        return float(row["accuracy_se"])
    if not (n > 0):
        return math.nan
    p = float(row["accuracy"])
    return math.sqrt(max(p * (1.0 - p), 0.0) / n)


def summarize_curve(curve: pd.DataFrame) -> dict:
    """Summary numbers of one run's eval curve (rows of eval_curves for one run); see DEFINITIONS."""
    c = curve.sort_values("step").reset_index(drop=True)
    nan = math.nan
    if c.empty:
        return dict(base=nan, peak=nan, peak_step=pd.NA, terminal=nan, terminal_mean3=nan, peak_confirmed=nan,
                    gain_peak=nan, gain_confirmed=nan, gain_terminal=nan, gain_terminal3=nan, se=nan, drop=nan,
                    drop_se=nan, cliff=False, collapse=False, stagnation=False, n_evals=0)  # fmt: skip
    acc = c["accuracy"].to_numpy(dtype=float)
    steps = c["step"].to_numpy()
    has_base = bool(steps[0] == 0)
    base = float(acc[0]) if has_base else nan
    n = eval_sizes(c)
    halves = [c[k].to_numpy(dtype=float) for k in HALF_COLUMNS]
    r = {k: v[0] for k, v in curve_tests(acc, n, *halves, has_base=has_base).items()}
    i = int(np.argmax(acc))
    peak, terminal = float(acc[i]), float(acc[-1])
    return dict(
        base=base,
        peak=peak,
        peak_step=int(steps[i]),
        terminal=terminal,
        terminal_mean3=float(r["terminal_mean"]),
        peak_confirmed=float(r["peak_confirmed"]),
        gain_peak=peak - base,
        gain_confirmed=float(r["peak_confirmed"]) - base,
        gain_terminal=terminal - base,
        gain_terminal3=float(r["terminal_mean"]) - base,
        se=peak_se(c, i, float(n[i])),
        drop=float(r["drop"]),
        drop_se=float(r["drop_se"]),
        cliff=bool(r["cliff"]),
        collapse=bool(r["collapse"]),
        stagnation=bool(r["stagnation"]),
        n_evals=len(c),
    )


def heldout_peak(curve: pd.DataFrame, val: pd.DataFrame, base: float) -> dict:
    """The peak selected on validation, read on the test problems, for one run.

    curve: the run's test accuracy per step (eval_curves rows); val: its validation accuracy per step (columns
    step, accuracy). peak_heldout_step is the step, among those with both evaluations (step 0 included, so a
    run whose validation accuracy never beats the base selects the base), with the highest validation
    accuracy (the first on ties); peak_heldout is the test accuracy there, gain_heldout = peak_heldout - base.
    NaN (step NA) without validation evaluations."""
    both = curve[["step", "accuracy"]].merge(val[["step", "accuracy"]], on="step", suffixes=("", "_val"))
    both = both[both["accuracy_val"].notna()].sort_values("step")
    if both.empty:
        return dict(peak_heldout_step=pd.NA, peak_heldout=math.nan, gain_heldout=math.nan)
    i = int(np.argmax(both["accuracy_val"].to_numpy(dtype=float)))
    test = float(both["accuracy"].iloc[i])
    return dict(peak_heldout_step=int(both["step"].iloc[i]), peak_heldout=test, gain_heldout=test - base)


def summarize_runs(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per run with SUMMARY_COLUMNS, sorted by run_id. Runs without eval accuracy get NaNs, n_evals 0."""
    curves = eval_curves(metrics)
    by_run = dict(tuple(curves.groupby("run_id", sort=True)))
    vals = wide(metrics, "val", "all", ["accuracy"])
    val_by_run = dict(tuple(vals.groupby("run_id", sort=True)))
    records = []
    for fac in run_factors(metrics).to_dict("records"):
        curve = by_run.get(fac["run_id"], curves.iloc[0:0])
        rec = {**fac, **summarize_curve(curve)}
        rec.update(heldout_peak(curve, val_by_run.get(fac["run_id"], vals.iloc[0:0]), rec["base"]))
        records.append(rec)
    out = pd.DataFrame.from_records(records, columns=SUMMARY_COLUMNS)
    out["peak_step"] = out["peak_step"].astype("Int64")
    out["peak_heldout_step"] = out["peak_heldout_step"].astype("Int64")
    out["n_evals"] = out["n_evals"].astype("int64")
    for c in ("cliff", "collapse", "stagnation"):
        out[c] = out[c].astype(bool)
    for c in FLOAT_SUMMARY:
        out[c] = out[c].astype("float64")
    return out
