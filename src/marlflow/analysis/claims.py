"""The claims table: each claim of the paper's abstract as a statistic, its CI across seeds and a verdict.

    claims = claims_table(summary, grads)   # CLAIM_COLUMNS, one row per claim C1..C7

Every statistic is computed once per seed (on the runs of that seed; seeds are independent replications of
the whole matrix), then averaged with a 95% t-interval over seeds (stats.mean_ci). Only runs without an
intervention count. Verdict rule (VERDICT_RULE): supported if the whole CI lies on the claimed side of the
null value, contradicted if it lies on the other side, inconclusive otherwise, and inconclusive whenever
fewer than 2 seeds give the statistic (no CI). The gains use gain_confirmed (the cross-fitted peak minus
base) when every run involved has it, else gain_peak.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd

from marlflow.analysis.definitions import PARALLEL_ROLE
from marlflow.analysis.stats import mean_ci

CLAIM_COLUMNS = ["claim", "text", "statistic", "value", "ci_lo", "ci_hi", "null", "direction", "n_seeds",
                 "n_cells", "verdict", "rule"]  # fmt: skip
VERDICT_RULE = ("supported if the 95% CI across seeds lies entirely above the null (below, for direction <); "
                "contradicted if entirely on the other side; otherwise, or with < 2 seeds, inconclusive")  # fmt: skip
MA = ("eval_opt", "voting", "orch_workers")
CELL3 = ["workflow", "scale", "task"]


def _gain(runs: pd.DataFrame) -> pd.Series:
    g = runs["gain_confirmed"].astype(float)
    return g if g.notna().all() and len(g) else runs["gain_peak"].astype(float)


def _peak(runs: pd.DataFrame) -> pd.Series:
    p = runs["peak_confirmed"].astype(float)
    return p if p.notna().all() and len(p) else runs["peak"].astype(float)


def _epsilon2(y: np.ndarray, groups: list) -> float:
    """Epsilon-squared effect size of a one-way grouping (nearly unbiased, unlike eta-squared which grows
    with the number of groups); NaN if undefined."""
    y = np.asarray(y, float)
    labels = pd.Series(groups)
    k = labels.nunique()
    if len(y) < 3 or k < 2 or k >= len(y):
        return math.nan
    ss_t = float(((y - y.mean()) ** 2).sum())
    if ss_t == 0:
        return math.nan
    means = pd.Series(y).groupby(labels.values).transform("mean").to_numpy()
    ss_b = float(((means - y.mean()) ** 2).sum())
    ms_w = (ss_t - ss_b) / (len(y) - k)
    return (ss_b - (k - 1) * ms_w) / ss_t


def c1(runs, grads):
    ma = runs[runs["workflow"].isin(MA)]
    return float((~ma["stagnation"].astype(bool)).mean()) if len(ma) else math.nan, len(ma)


def c2(runs, grads):
    ma = runs[runs["workflow"].isin(MA)]
    if ma.empty:
        return math.nan, 0
    y = _gain(ma).to_numpy()
    wts = list(zip(ma["workflow"], ma["task"], ma["scale"]))
    return _epsilon2(y, wts) - _epsilon2(y, list(ma["sharing"])), len(ma)


def _sp_ip_pairs(runs):
    ma = runs[runs["workflow"].isin(MA)]
    return ma[ma["sharing"] == "sp"].merge(ma[ma["sharing"] == "ip"], on=CELL3, suffixes=("_sp", "_ip"))


def c3(runs, grads):
    p = _sp_ip_pairs(runs)
    if p.empty:
        return math.nan, 0
    sp = _peak(p.rename(columns={"peak_sp": "peak", "peak_confirmed_sp": "peak_confirmed"}))
    ip = _peak(p.rename(columns={"peak_ip": "peak", "peak_confirmed_ip": "peak_confirmed"}))
    return float((ip - sp).mean()), len(p)


def c4(runs, grads):
    p = _sp_ip_pairs(runs)
    if p.empty:
        return math.nan, 0
    return float((p["cliff_ip"].astype(float) - p["cliff_sp"].astype(float)).mean()), len(p)


def c5(runs, grads):
    ip = runs[(runs["sharing"] == "ip") & runs["workflow"].isin(MA)]
    par = ip[ip["workflow"].isin(PARALLEL_ROLE)]
    other = ip[~ip["workflow"].isin(PARALLEL_ROLE)]
    if par.empty or other.empty:
        return math.nan, len(ip)
    return float(par["cliff"].astype(float).mean() - other["cliff"].astype(float).mean()), len(ip)


def c6(runs, grads):
    g = grads[(grads["sharing"] == "ip") & grads["workflow"].isin(MA)]
    g = g[g["run_id"].isin(runs["run_id"])].dropna(subset=["slot_amplification_mean"])
    par = g[g.apply(lambda r: PARALLEL_ROLE.get(r["workflow"]) == r["role"], axis=1)] if len(g) else g
    other = g[~g["workflow"].isin(PARALLEL_ROLE)]
    if par.empty or other.empty:
        return math.nan, int(g["run_id"].nunique()) if len(g) else 0
    diff = par["slot_amplification_mean"].mean() - other["slot_amplification_mean"].mean()
    return float(diff), int(g["run_id"].nunique())


def c7(runs, grads):
    g = grads[(grads["sharing"] == "sp") & grads["workflow"].isin(MA) & grads["dominant"].astype(bool)]
    g = g[g["run_id"].isin(runs["run_id"])].dropna(subset=["drift_corr"])
    return (float(g["drift_corr"].mean()) if len(g) else math.nan), int(len(g))


# claim, text, statistic, function, null, direction
CLAIMS: list[tuple[str, str, str, Callable, float, str]] = [
    ("C1", "MA-RL improves over base in most cells",
     "share of multi-agent runs whose gain over base is significant (not stagnation)", c1, 0.5, ">"),
    ("C2", "gains depend on workflow, task and scale, not on sharing alone",
     "epsilon^2 of the gain by (workflow, task, scale) minus epsilon^2 by sharing, multi-agent runs", c2, 0.0,
     ">"),
    ("C3", "IP reaches a higher peak than SP",
     "mean over (workflow, task, scale) of peak IP - peak SP (peak_confirmed if logged)", c3, 0.0, ">"),
    ("C4", "IP falls off terminal cliffs more often than SP",
     "mean over (workflow, task, scale) of cliff IP - cliff SP (0/1)", c4, 0.0, ">"),
    ("C5", "IP cliffs concentrate in Voting and Orch-Workers",
     "IP cliff rate in voting and orch_workers minus IP cliff rate in eval_opt", c5, 0.0, ">"),
    ("C6", "under IP, same-role amplification is larger in Voting and Orch-Workers",
     "IP mean slot_amplification of the parallel role (voting generator, orch_workers worker) minus that of "
     "eval_opt's multi-round roles", c6, 0.0, ">"),
    ("C7", "under SP, the dominant role's mass share goes with the other roles' drift",
     "mean over SP multi-agent runs of drift_corr (dominant role's proj_share vs the other roles' 1 - ema_cos)",
     c7, 0.0, ">"),
]  # fmt: skip


def verdict(lo: float, hi: float, null: float, direction: str) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    above, below = lo > null, hi < null
    if direction == "<":
        above, below = below, above
    return "supported" if above else "contradicted" if below else "inconclusive"


def claims_table(summary: pd.DataFrame, grads: pd.DataFrame) -> pd.DataFrame:
    """One row per claim (CLAIM_COLUMNS); see the module docstring for the rule."""
    runs = summary[(summary["n_evals"] > 0) & (summary["intervention"] == "none")]
    records = []
    for cid, text, stat, fn, null, direction in CLAIMS:
        per_seed, cells = [], 0
        for _, r in runs.groupby("seed", sort=True):
            value, n = fn(r, grads)
            per_seed.append(value)
            cells = max(cells, n)
        m, lo, hi, s = mean_ci(per_seed)
        records.append([cid, text, stat, m, lo, hi, null, direction, s, cells, verdict(lo, hi, null, direction),
                        VERDICT_RULE])  # fmt: skip
    out = pd.DataFrame.from_records(records, columns=CLAIM_COLUMNS)
    out["n_seeds"] = out["n_seeds"].astype("int64")
    out["n_cells"] = out["n_cells"].astype("int64")
    return out
