"""The claims table: each claim of the paper's abstract as a statistic, its CI across seeds and a verdict.

    claims = claims_table(summary, grads)   # CLAIM_COLUMNS, one row per claim C1..C7

Most statistics are computed once per replicate (a seed, or a (seed, build) pair when the runs carry the toy
build column: seeds.replicate_keys; replicates are independent replications of the whole matrix), then
averaged with a t-interval over replicates (stats.mean_ci; n_seeds counts replicates). The rate differences of
0/1 flags (C4: paired SP/IP cells; C5: two groups of runs) pool every replicate's runs instead, with Newcombe's
score interval for a difference of proportions (stats.rate_diff_ci). Only runs without an intervention count.

Verdict rule (VERDICT_RULE, docs/claims.md section 2): a claim gets a verdict only if its statistic has been
validated to measure it (VALIDATED, with how); the others are "descriptive". The intervals of the validated
claims are Bonferroni-corrected over them (each at 1 - 0.05 / len(VALIDATED): the chance that any verdict is
wrong under the null stays <= 5%, simulated in tests/test_seeds_claims.py). Supported if the whole corrected
CI lies on the claimed side of the null value, contradicted if on the other side, inconclusive otherwise,
with fewer than 2 seeds, or with a zero-width interval (e.g. a share of 1 in every seed: no variance is not
certainty). `scope` says when every run is of a designed environment (toy, smol), which the verdicts then
describe. Peaks and gains use the held-out peak (selected on validation, read on test) when every run
involved has it, else the cross-fitted peak_confirmed (tables.PEAK_ESTIMATES); never the in-sample `peak`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd

from marlflow.analysis.seeds import n_replicates, replicate_keys
from marlflow.analysis.tables import PEAK_ESTIMATES
from marlflow.core.definitions import CI_LEVEL, parallel_role
from marlflow.core.stats import mean_ci, rate_diff_ci
from marlflow.core.workflow_spec import baseline

CLAIM_COLUMNS = ["claim", "text", "statistic", "value", "ci_lo", "ci_hi", "null", "direction", "n_seeds",
                 "n_cells", "verdict", "rule", "ci_level", "scope"]  # fmt: skip
FAMILY_ALPHA = 0.05  # the chance that any verdict of the table is wrong under the null (Bonferroni)
# claim -> how its statistic was validated to measure the claim (docs/claims.md section 2). Claims not here
# are tabulated as "descriptive": their statistic has not been shown to measure what the claim says.
VALIDATED = {
    "C1": "stagnation test calibrated by simulation (tests/test_calibration.py: flat runs 95-99% stagnation)",
    "C3": "held-out / cross-fitted peaks are unbiased for flat curves (tests/test_calibration.py)",
    "C4": "cliff test calibrated: <= 4.1% false cliffs (tests/test_calibration.py); paired Newcombe interval",
    "C5": "cliff test calibrated (as C4); Newcombe interval for two independent rates",
}
DESIGNED = ("toy", "smol")  # scales that are designed environments: verdicts describe that environment
VERDICT_RULE = (f"validated claims only (others: descriptive); intervals Bonferroni-corrected over the "
                f"{len(VALIDATED)} validated claims (each at {1 - FAMILY_ALPHA / len(VALIDATED):.4g}); supported "
                "if the corrected CI lies entirely above the null (below, for direction <), contradicted if "
                "entirely on the other side; otherwise, with < 2 seeds or a zero-width CI, inconclusive")  # fmt: skip


def _ma(df: pd.DataFrame) -> pd.Series:
    """Rows of multi-agent workflows: every workflow but the single-agent baseline (WorkflowSpec.baseline)."""
    return df["workflow"].ne(baseline())


def _parallel(df: pd.DataFrame) -> pd.Series:
    """Rows of workflows with parallel same-role calls (WorkflowSpec.parallel_role: Voting, Orch-Workers)."""
    return df["workflow"].map(lambda w: parallel_role(w) is not None).astype(bool)


CELL3 = ["workflow", "scale", "task"]


def _first_complete(runs: pd.DataFrame, columns: list[str]) -> pd.Series:
    """The first of `columns` present with a value for every run (the last one otherwise)."""
    for c in columns[:-1]:
        if c in runs.columns and len(runs) and runs[c].notna().all():
            return runs[c].astype(float)
    return runs[columns[-1]].astype(float)


def _gain(runs: pd.DataFrame) -> pd.Series:
    return _first_complete(runs, [gain for gain, _ in PEAK_ESTIMATES.values()])


def _peak(runs: pd.DataFrame) -> pd.Series:
    return _first_complete(runs, list(PEAK_ESTIMATES))


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
    ma = runs[_ma(runs)]
    return float((~ma["stagnation"].astype(bool)).mean()) if len(ma) else math.nan, len(ma)


def c2(runs, grads):
    ma = runs[_ma(runs)]
    if ma.empty:
        return math.nan, 0
    y = _gain(ma).to_numpy()
    wts = list(zip(ma["workflow"], ma["task"], ma["scale"]))
    return _epsilon2(y, wts) - _epsilon2(y, list(ma["sharing"])), len(ma)


def _sp_ip_pairs(runs):
    ma = runs[_ma(runs)]
    return ma[ma["sharing"] == "sp"].merge(ma[ma["sharing"] == "ip"], on=CELL3, suffixes=("_sp", "_ip"))


def _side(p: pd.DataFrame, suffix: str) -> pd.DataFrame:
    cols = [c for c in p.columns if c.endswith(suffix)]
    return p[cols].rename(columns={c: c[: -len(suffix)] for c in cols})


def c3(runs, grads):
    p = _sp_ip_pairs(runs)
    if p.empty:
        return math.nan, 0
    return float((_peak(_side(p, "_ip")).to_numpy() - _peak(_side(p, "_sp")).to_numpy()).mean()), len(p)


def c4(runs, grads, level):
    """Pooled over replicates: IP - SP cliff rate over (workflow, task, scale, replicate) pairs, paired
    interval."""
    p = runs[_ma(runs)]
    on = [*CELL3, *replicate_keys(p)]
    p = p[p["sharing"] == "sp"].merge(p[p["sharing"] == "ip"], on=on, suffixes=("_sp", "_ip"))
    m, lo, hi, n = rate_diff_ci(p["cliff_ip"].astype(float), p["cliff_sp"].astype(float), level, paired=True)
    return m, lo, hi, n


def c5(runs, grads, level):
    """Pooled over replicates: IP cliff rate in voting / orch_workers minus in eval_opt, independent groups."""
    ip = runs[(runs["sharing"] == "ip") & _ma(runs)]
    par = ip[_parallel(ip)]["cliff"].astype(float)
    other = ip[~_parallel(ip)]["cliff"].astype(float)
    return rate_diff_ci(par, other, level)


def c6(runs, grads):
    g = grads[(grads["sharing"] == "ip") & _ma(grads)]
    g = g[g["run_id"].isin(runs["run_id"])].dropna(subset=["slot_amplification_mean"])
    par = g[g.apply(lambda r: parallel_role(r["workflow"]) == r["role"], axis=1)] if len(g) else g
    other = g[~_parallel(g)]
    if par.empty or other.empty:
        return math.nan, int(g["run_id"].nunique()) if len(g) else 0
    diff = par["slot_amplification_mean"].mean() - other["slot_amplification_mean"].mean()
    return float(diff), int(g["run_id"].nunique())


def c7(runs, grads):
    g = grads[(grads["sharing"] == "sp") & _ma(grads) & grads["dominant"].astype(bool)]
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
     "mean over (workflow, task, scale) of peak IP - peak SP (peak_heldout, else peak_confirmed)", c3, 0.0, ">"),
    ("C4", "IP falls off terminal cliffs more often than SP",
     "cliff rate IP - SP over (workflow, task, scale, replicate) pairs (0/1, pooled over replicates)", c4, 0.0, ">"),
    ("C5", "IP cliffs concentrate in Voting and Orch-Workers",
     "IP cliff rate in voting and orch_workers minus IP cliff rate in eval_opt (pooled over replicates)", c5, 0.0,
     ">"),
    ("C6", "under IP, same-role amplification is larger in Voting and Orch-Workers",
     "IP mean slot_amplification of the parallel role (voting generator, orch_workers worker) minus that of "
     "eval_opt's multi-round roles", c6, 0.0, ">"),
    ("C7", "under SP, the dominant role's mass share goes with the other roles' drift",
     "mean over SP multi-agent runs of drift_corr (dominant role's proj_share vs the other roles' 1 - ema_cos)",
     c7, 0.0, ">"),
]  # fmt: skip


POOLED = {"C4", "C5"}  # claims whose function pools every seed and returns (value, lo, hi, n) at a level


def verdict(lo: float, hi: float, null: float, direction: str) -> str:
    """The rule for a validated claim's (corrected) interval; a zero-width one is inconclusive."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi - lo <= 1e-12:
        return "inconclusive"
    above, below = lo > null, hi < null
    if direction == "<":
        above, below = below, above
    return "supported" if above else "contradicted" if below else "inconclusive"


def claims_table(summary: pd.DataFrame, grads: pd.DataFrame) -> pd.DataFrame:
    """One row per claim (CLAIM_COLUMNS); see the module docstring for the rule."""
    runs = summary[(summary["n_evals"] > 0) & (summary["intervention"] == "none")]
    level = 1 - FAMILY_ALPHA / len(VALIDATED)
    designed = len(runs) > 0 and set(runs["scale"]) <= set(DESIGNED)
    scope = f"designed environment ({', '.join(sorted(set(runs['scale'])))})" if designed else ""
    n_seeds = n_replicates(runs)  # replicates: seeds, or (seed, build) pairs
    records = []
    for cid, text, stat, fn, null, direction in CLAIMS:
        if cid in POOLED:
            m, lo, hi, cells = fn(runs, grads, level)
            s = n_seeds
            if s < 2:  # one seed: a single replication of the matrix, no interval across seeds
                lo = hi = math.nan
        else:
            per_seed, cells = [], 0
            for _, r in runs.groupby(replicate_keys(runs), sort=True):
                value, n = fn(r, grads)
                per_seed.append(value)
                cells = max(cells, n)
            m, lo, hi, s = mean_ci(per_seed, level if cid in VALIDATED else CI_LEVEL)
        v = verdict(lo, hi, null, direction) if cid in VALIDATED else "descriptive"
        records.append([cid, text, stat, m, lo, hi, null, direction, s, cells, v, VERDICT_RULE,
                        level if cid in VALIDATED else CI_LEVEL, scope])  # fmt: skip
    out = pd.DataFrame.from_records(records, columns=CLAIM_COLUMNS)
    out["n_seeds"] = out["n_seeds"].astype("int64")
    out["n_cells"] = out["n_cells"].astype("int64")
    return out
