"""Gradient dynamics per run x role, from the train-split per-role gradient metrics trainer.update logs.

    grads = grad_dynamics(metrics)   # GRAD_COLUMNS, one row per run x role, sorted

grad_norm_mean/max over train steps; grad_share_mean; grad_share_early/late = mean over the first/last
ceil(n/3) train steps; grad_share_shift = late - early; norm_ratio = largest/smallest role grad_norm_mean in the
run; dominant = role with the largest proj_share mean (grad_share if proj_share is not logged);
share_drop_corr = Pearson correlation over eval intervals (s_prev, s] of the role's mean grad_share in the
interval with acc(s_prev) - acc(s); <metric>_mean for the metrics in MEAN_METRICS; drift_corr (SP, dominant
role only) = correlation over train steps of its proj_share with the mean drift (1 - ema_cos) of the other
roles. Definitions: definitions.DEFINITIONS.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from marlflow.analysis.curves import eval_curves, wide
from marlflow.store.schema import FACTOR_COLUMNS

GRAD_COLUMNS = [
    *FACTOR_COLUMNS,
    "role",
    "n_steps",
    "grad_norm_mean",
    "grad_norm_max",
    "grad_share_mean",
    "grad_share_early",
    "grad_share_late",
    "grad_share_shift",
    "norm_ratio",
    "dominant",
    "share_drop_corr",
    "proj_share_mean",
    "cos_others_mean",
    "slot_amplification_mean",
    "slot_cos_mean",
    "ema_cos_mean",
    "clip_coef_mean",
    "grad_contrib_post_mean",
    "drift_corr",
]
MEAN_METRICS = ["proj_share", "cos_others", "slot_amplification", "slot_cos", "ema_cos", "clip_coef",
                "grad_contrib_post"]  # fmt: skip
SERIES_METRICS = ["grad_norm", "grad_share", *MEAN_METRICS]


def role_train_series(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per-role train rows (not role "all") as a wide table: factors, step, role, SERIES_METRICS."""
    out = wide(metrics, "train", None, SERIES_METRICS)
    return out[out["role"] != "all"].reset_index(drop=True)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; NaN with fewer than 3 points or a constant series."""
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def share_drop_corr(role_series: pd.DataFrame, curve: pd.DataFrame) -> float:
    """Correlation of a role's mean grad_share per eval interval with the accuracy drop over that interval."""
    c = curve.sort_values("step")
    steps, acc = c["step"].to_numpy(), c["accuracy"].to_numpy(dtype=float)
    xs, ys = [], []
    for k in range(1, len(steps)):
        m = role_series[(role_series["step"] > steps[k - 1]) & (role_series["step"] <= steps[k])]
        share = m["grad_share"].mean()
        if pd.notna(share):
            xs.append(float(share))
            ys.append(float(acc[k - 1] - acc[k]))
    return pearson(np.array(xs), np.array(ys))


def run_dynamics(series: pd.DataFrame, curve: pd.DataFrame, sharing: str = "") -> list[dict]:
    """Rows of GRAD_COLUMNS (without factors) for one run's per-role train series."""
    steps = np.sort(series["step"].unique())
    n = len(steps)
    third = math.ceil(n / 3)
    early, late = set(steps[:third]), set(steps[n - third :])
    rows = []
    for role, s in series.groupby("role", sort=True):
        e = s[s["step"].isin(early)]["grad_share"].mean()
        lt = s[s["step"].isin(late)]["grad_share"].mean()
        rows.append(
            dict(
                role=role,
                n_steps=int(s["step"].nunique()),
                grad_norm_mean=s["grad_norm"].mean(),
                grad_norm_max=s["grad_norm"].max(),
                grad_share_mean=s["grad_share"].mean(),
                grad_share_early=e,
                grad_share_late=lt,
                grad_share_shift=lt - e,
                share_drop_corr=share_drop_corr(s, curve),
                **{f"{m}_mean": s[m].mean() for m in MEAN_METRICS},
                drift_corr=math.nan,
            )
        )
    norms = [r["grad_norm_mean"] for r in rows if pd.notna(r["grad_norm_mean"])]
    ratio = max(norms) / min(norms) if norms and min(norms) > 0 else math.nan
    key = "proj_share_mean" if any(pd.notna(r["proj_share_mean"]) for r in rows) else "grad_share_mean"
    top, best = None, -math.inf
    for r in rows:  # rows are sorted by role: ties go to the alphabetically first role
        if pd.notna(r[key]) and r[key] > best:
            top, best = r["role"], r[key]
    for r in rows:
        r["norm_ratio"] = ratio
        r["dominant"] = r["role"] == top
        if r["dominant"] and sharing == "sp" and len(rows) > 1:
            r["drift_corr"] = drift_corr(series, top)
    return rows


def drift_corr(series: pd.DataFrame, dominant: str) -> float:
    """Correlation over train steps of the dominant role's proj_share with the other roles' mean drift
    (1 - ema_cos); NaN with fewer than 3 steps where both exist."""
    dom = series[series["role"] == dominant].set_index("step")["proj_share"]
    others = series[series["role"] != dominant].groupby("step")["ema_cos"].mean()
    both = pd.concat([dom, 1.0 - others], axis=1, keys=["share", "drift"]).dropna()
    return pearson(both["share"].to_numpy(float), both["drift"].to_numpy(float))


def grad_dynamics(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per run x role with GRAD_COLUMNS, sorted by run_id, role; empty if no per-role train rows."""
    series = role_train_series(metrics)
    curves = eval_curves(metrics)
    curves_by_run = dict(tuple(curves.groupby("run_id", sort=True)))
    records = []
    for rid, s in series.groupby("run_id", sort=True):
        fac = s[FACTOR_COLUMNS].iloc[0].to_dict()
        for r in run_dynamics(s, curves_by_run.get(rid, curves.iloc[0:0]), str(fac["sharing"])):
            records.append({**fac, **r})
    out = pd.DataFrame.from_records(records, columns=GRAD_COLUMNS)
    out["n_steps"] = out["n_steps"].astype("int64")
    out["dominant"] = out["dominant"].astype(bool)
    for c in GRAD_COLUMNS[GRAD_COLUMNS.index("grad_norm_mean") :]:
        if c not in ("dominant",):
            out[c] = out[c].astype("float64")
    return out.sort_values(["run_id", "role"]).reset_index(drop=True)
