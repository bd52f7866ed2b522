"""The claims table: each claim of the paper's abstract as a statistic, its interval, a verdict and the smallest
effect the committed replicates could have detected; and the simulation that calibrates the verdict rule.

    claims = claims_table(summary, grads)       # CLAIM_COLUMNS, one row per claim C1..C7 (+ C3 per task)
    shape = NullShape.from_summary(summary)     # the matrix a summary has, for simulating the rule
    draws = simulate(shape, rng, 10_000)        # 10^4 matrices under the null (or an effect)
    rule = rule_on_draws(shape, draws)          # claim -> (value, lo, hi, verdict code), arrays (10^4,)

Each validated claim is one of four kinds, and its interval comes from one vectorised function of its counts
(core.stats), which claims_table and the simulation both call (docs/claims.md section 2):
- C1, "count": multi-agent runs that do not stagnate, counted over every replicate; the exact binomial test
  against a share of 0.5 with its Clopper-Pearson interval (stats.clopper_pearson): 72 of 72 is evidence.
- C3, "replicate": computed once per replicate (a seed, or a (seed, build) pair when the runs carry the toy
  build column: seeds.replicate_keys), then a t-interval over replicates (stats.mean_ci_rows; n_seeds counts
  replicates). With more than one task, rows "C3 <task>" give it per task, descriptively (a math difference
  is not diluted by code cells at their ceiling).
- C4, "pairs": IP and SP cliff flags paired by (workflow, task, scale, replicate), Tango's score interval
  (stats.tango_ci; Newcombe's paired interval exceeded its level).
- C5, "groups": IP cliff flags of Voting / Orch-Workers vs Eval-Opt, Newcombe's interval (stats.newcombe_ci).
C2, C6, C7 are descriptive: a per-replicate statistic with a 95% t-interval over replicates. Only runs without
an intervention count.

Verdict rule (VERDICT_RULE): a claim gets a verdict only if its statistic has been validated to measure it
(VALIDATED). Their intervals are Bonferroni-corrected (each at 1 - 0.05 / len(VALIDATED)); supported if the
whole interval lies on the claimed side of the null value, contradicted if on the other side, inconclusive
otherwise, with fewer than 2 replicates, or with a zero-width interval (a t-interval over identical values).
The chance that any verdict is wrong when every null holds is simulated by tests/test_claims_power.py
(10^4+ matrices per seed, at several seeds). `mde`: the smallest true effect (statistic minus null) the row's
interval would put on the claimed side with probability 0.8 at its level, from the data's own variance at the
committed replicates (stats.mde_*). Replicates are treated as exchangeable: with two toy builds the build
variance is inside the replicate variance, not estimated as a factor, so an interval speaks for these builds.
`scope` says when every run is of a designed environment (the toy scales, smol). Peaks and gains use the
held-out peak (selected on validation, read on test) when every run involved has it, else the cross-fitted
peak_confirmed (tables.PEAK_ESTIMATES); never the in-sample `peak`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from marlflow.analysis.seeds import n_replicates, replicate_keys
from marlflow.analysis.tables import PEAK_ESTIMATES, TASK_ORDER, order_key
from marlflow.core.config import TOY_SCALES
from marlflow.core.definitions import CI_LEVEL, parallel_role
from marlflow.core.stats import (
    binom_pmf,
    clopper_pearson,
    mde_mean,
    mde_paired_rates,
    mde_rate,
    mde_two_rates,
    mean_ci_rows,
    newcombe_ci,
    normal_quantile,
    rate_diff_ci,
    tango_ci,
    wilson_arr,
)
from marlflow.core.workflow_spec import baseline

CLAIM_COLUMNS = ["claim", "text", "statistic", "value", "ci_lo", "ci_hi", "null", "direction", "n_seeds",
                 "n_cells", "verdict", "mde", "rule", "ci_level", "scope"]  # fmt: skip
FAMILY_ALPHA = 0.05  # the chance that any verdict of the table is wrong under the null (Bonferroni)
POWER = 0.8  # the power at which `mde` is stated
# claim -> how its statistic was validated to measure the claim (docs/claims.md section 2). Claims not here
# are tabulated as "descriptive": their statistic has not been shown to measure what the claim says.
VALIDATED = {
    "C1": "stagnation test calibrated by simulation (tests/test_calibration.py); exact binomial test over runs",
    "C3": "held-out / cross-fitted peaks are unbiased for flat curves (tests/test_calibration.py)",
    "C4": "cliff test calibrated: <= 4.1% false cliffs (tests/test_calibration.py); Tango's paired interval",
    "C5": "cliff test calibrated (as C4); Newcombe interval for two independent rates",
}
DESIGNED = (*TOY_SCALES, "smol")  # scales that are designed environments: verdicts describe that environment
LEVEL = 1 - FAMILY_ALPHA / len(VALIDATED)  # each validated claim's interval
VERDICT_RULE = (f"validated claims only (others: descriptive); intervals Bonferroni-corrected over the "
                f"{len(VALIDATED)} validated claims (each at {LEVEL:.4g}); supported if the corrected CI lies "
                "entirely above the null (below, for direction <), contradicted if entirely on the other side; "
                "otherwise, with < 2 replicates or a zero-width CI, inconclusive; mde: the effect found with "
                f"power {POWER} at that level")  # fmt: skip
VERDICTS = {1: "supported", -1: "contradicted", 0: "inconclusive"}


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


# --------------------------------------------------------------------------------------- the claims' statistics


def c1(runs, grads):
    """(k, n): multi-agent runs without stagnation, of all multi-agent runs."""
    ma = runs[_ma(runs)]
    return int((~ma["stagnation"].astype(bool)).sum()), len(ma)


def c2(runs, grads):
    ma = runs[_ma(runs)]
    if ma.empty:
        return math.nan, 0
    y = _gain(ma).to_numpy()
    wts = list(zip(ma["workflow"], ma["task"], ma["scale"]))
    return _epsilon2(y, wts) - _epsilon2(y, list(ma["sharing"])), len(ma)


def _sp_ip_pairs(runs, on=CELL3):
    ma = runs[_ma(runs)]
    return ma[ma["sharing"] == "sp"].merge(ma[ma["sharing"] == "ip"], on=on, suffixes=("_sp", "_ip"))


def _side(p: pd.DataFrame, suffix: str) -> pd.DataFrame:
    cols = [c for c in p.columns if c.endswith(suffix)]
    return p[cols].rename(columns={c: c[: -len(suffix)] for c in cols})


def c3(runs, grads):
    """(mean over the replicate's cells of peak IP - peak SP, cells)."""
    p = _sp_ip_pairs(runs)
    if p.empty:
        return math.nan, 0
    return float((_peak(_side(p, "_ip")).to_numpy() - _peak(_side(p, "_sp")).to_numpy()).mean()), len(p)


def c4(runs, grads):
    """(b, c, n) over the (workflow, task, scale, replicate) pairs: IP cliff without SP cliff, SP without IP."""
    p = _sp_ip_pairs(runs, [*CELL3, *replicate_keys(runs)])
    ip, sp = p["cliff_ip"].astype(bool), p["cliff_sp"].astype(bool)
    return int((ip & ~sp).sum()), int((~ip & sp).sum()), len(p)


def c5(runs, grads):
    """(x1, n1, x2, n2): IP cliffs in Voting / Orch-Workers runs, and in Eval-Opt (the others) runs."""
    ip = runs[(runs["sharing"] == "ip") & _ma(runs)]
    par = ip[_parallel(ip)]["cliff"].astype(bool)
    other = ip[~_parallel(ip)]["cliff"].astype(bool)
    return int(par.sum()), len(par), int(other.sum()), len(other)


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


# ---------------------------------------------------------------------------- intervals and MDE, by kind
# Each takes the kind's counts (arrays, any shape) and a level; claims_table and rule_on_draws both call them.


def count_ci(k, n, level):
    """C1: (share k / n, Clopper-Pearson lo, hi)."""
    k, n = np.asarray(k), int(n)
    if n < 1:
        nan = np.full(k.shape, np.nan)
        return nan, nan, nan
    lo, hi = clopper_pearson(k, n, level)
    return k / n, lo, hi


def pairs_ci(b, c, n, level):
    """C4: ((b - c) / n, Tango's lo, hi)."""
    b, c = np.asarray(b, dtype=float), np.asarray(c, dtype=float)
    lo, hi = tango_ci(b, c, n, level)
    return (b - c) / n if n else np.full(b.shape, np.nan), lo, hi


def groups_ci(x1, n1, x2, n2, level):
    """C5: (x1 / n1 - x2 / n2, Newcombe's lo, hi); NaN where a group is empty."""
    x1, x2 = np.asarray(x1, dtype=float), np.asarray(x2, dtype=float)
    if n1 < 1 or n2 < 1:
        nan = np.full(np.broadcast(x1, x2).shape, np.nan)
        return nan, nan, nan
    return x1 / n1 - x2 / n2, *newcombe_ci(x1, n1, x2, n2, level)


def _mde(kind: str, data, null: float, level: float) -> float:
    """The row's minimum detectable effect at `level` and power POWER from its own data (stats.mde_*)."""
    if kind == "replicate":
        x = np.asarray(data, dtype=float)
        return mde_mean(float(x.std(ddof=1)), len(x), level, POWER) if len(x) >= 2 else math.nan
    if kind == "count":
        return mde_rate(data[1], null, level, POWER)
    if kind == "pairs":
        b, c, n = data
        return mde_paired_rates(n, (b + c) / (2 * n), level, POWER) if n else math.nan
    x1, n1, x2, n2 = data
    return mde_two_rates(n1, n2, (x1 + x2) / (n1 + n2), level, POWER) if n1 and n2 else math.nan


POOLED_CI = {"count": count_ci, "pairs": pairs_ci, "groups": groups_ci}


def verdict_codes(lo, hi, null: float, direction: str) -> np.ndarray:
    """The verdict rule on (corrected) intervals, arrays: 1 supported, -1 contradicted, 0 inconclusive (also for a
    zero-width or missing interval)."""
    lo, hi = np.asarray(lo, dtype=float), np.asarray(hi, dtype=float)
    ok = np.isfinite(lo) & np.isfinite(hi) & (hi - lo > 1e-12)
    above, below = lo > null, hi < null
    if direction == "<":
        above, below = below, above
    return np.where(ok & above, 1, np.where(ok & below, -1, 0))


def verdict(lo: float, hi: float, null: float, direction: str) -> str:
    """The rule for a validated claim's (corrected) interval; a zero-width one is inconclusive."""
    return VERDICTS[int(verdict_codes(lo, hi, null, direction))]


@dataclass(frozen=True)
class Claim:
    cid: str
    text: str
    statistic: str
    fn: Callable
    null: float
    direction: str
    kind: str  # "replicate" (fn per replicate -> (value, n)), "count", "pairs" or "groups" (fn on every run)


CLAIMS: list[Claim] = [
    Claim("C1", "MA-RL improves over base in most cells",
          "share of multi-agent runs whose gain over base is significant (not stagnation), pooled over "
          "replicates (exact binomial, Clopper-Pearson)", c1, 0.5, ">", "count"),
    Claim("C2", "gains depend on workflow, task and scale, not on sharing alone",
          "epsilon^2 of the gain by (workflow, task, scale) minus epsilon^2 by sharing, multi-agent runs", c2,
          0.0, ">", "replicate"),
    Claim("C3", "IP reaches a higher peak than SP",
          "mean over (workflow, task, scale) of peak IP - peak SP (peak_heldout, else peak_confirmed)", c3, 0.0,
          ">", "replicate"),
    Claim("C4", "IP falls off terminal cliffs more often than SP",
          "cliff rate IP - SP over (workflow, task, scale, replicate) pairs (0/1, pooled over replicates; "
          "Tango's score interval)", c4, 0.0, ">", "pairs"),
    Claim("C5", "IP cliffs concentrate in Voting and Orch-Workers",
          "IP cliff rate in voting and orch_workers minus IP cliff rate in eval_opt (pooled over replicates; "
          "Newcombe)", c5, 0.0, ">", "groups"),
    Claim("C6", "under IP, same-role amplification is larger in Voting and Orch-Workers",
          "IP mean slot_amplification of the parallel role (voting generator, orch_workers worker) minus that of "
          "eval_opt's multi-round roles", c6, 0.0, ">", "replicate"),
    Claim("C7", "under SP, the dominant role's mass share goes with the other roles' drift",
          "mean over SP multi-agent runs of drift_corr (dominant role's proj_share vs the other roles' 1 - "
          "ema_cos)", c7, 0.0, ">", "replicate"),
]  # fmt: skip


def _row(claim: Claim, runs: pd.DataFrame, grads: pd.DataFrame, n_seeds: int, level: float, mde: bool):
    """(value, lo, hi, n_seeds, n_cells, mde) of one claim on `runs` at `level`."""
    if claim.kind == "replicate":
        per_seed, cells = [], 0
        for _, r in runs.groupby(replicate_keys(runs), sort=True):
            value, n = claim.fn(r, grads)
            per_seed.append(value)
            cells = max(cells, n)
        x = np.asarray([v for v in per_seed if math.isfinite(v)], dtype=float)
        m, lo, hi = (float(v) for v in mean_ci_rows(x, level))
        e = _mde("replicate", x, claim.null, level) if mde else math.nan
        return m, lo, hi, len(x), cells, e
    data = claim.fn(runs, grads)
    m, lo, hi = (float(v) for v in POOLED_CI[claim.kind](*data, level))
    cells = data[-1] if claim.kind != "groups" else data[1] + data[3]
    if n_seeds < 2:  # one replication of the matrix: no interval, so no verdict and no power to state
        return m, math.nan, math.nan, n_seeds, cells, math.nan
    return m, lo, hi, n_seeds, cells, _mde(claim.kind, data, claim.null, level) if mde else math.nan


def claims_table(summary: pd.DataFrame, grads: pd.DataFrame) -> pd.DataFrame:
    """One row per claim (CLAIM_COLUMNS), and C3 per task where there are several; see the module docstring."""
    runs = summary[(summary["n_evals"] > 0) & (summary["intervention"] == "none")]
    designed = len(runs) > 0 and set(runs["scale"]) <= set(DESIGNED)
    scope = f"designed environment ({', '.join(sorted(set(runs['scale'])))})" if designed else ""
    n_seeds = n_replicates(runs)  # replicates: seeds, or (seed, build) pairs
    records = []
    for claim in CLAIMS:
        valid = claim.cid in VALIDATED
        level = LEVEL if valid else CI_LEVEL
        m, lo, hi, s, cells, e = _row(claim, runs, grads, n_seeds, level, mde=valid)
        v = VERDICTS[int(verdict_codes(lo, hi, claim.null, claim.direction))] if valid else "descriptive"
        records.append([claim.cid, claim.text, claim.statistic, m, lo, hi, claim.null, claim.direction, s, cells,
                        v, e, VERDICT_RULE, level, scope])  # fmt: skip
        if claim.cid == "C3" and runs["task"].nunique() > 1:  # per task: descriptive, at C3's level
            for task in sorted(runs["task"].unique(), key=order_key(TASK_ORDER)):
                m, lo, hi, s, cells, e = _row(claim, runs[runs["task"] == task], grads, n_seeds, level, True)
                records.append([f"C3 {task}", f"{claim.text}: {task} cells alone", f"as C3, {task} cells only",
                                m, lo, hi, claim.null, claim.direction, s, cells, "descriptive", e, VERDICT_RULE,
                                level, scope])  # fmt: skip
    out = pd.DataFrame.from_records(records, columns=CLAIM_COLUMNS)
    out["n_seeds"] = out["n_seeds"].astype("int64")
    out["n_cells"] = out["n_cells"].astype("int64")
    return out


# ------------------------------------------------------------------------------- simulating the verdict rule


@dataclass(frozen=True)
class NullShape:
    """A matrix shaped like a summary's, for simulating the validated claims: `replicates` replications of the
    multi-agent cells (workflow, scale, task), each with an SP and an IP run; which cells have a parallel role
    (C5); each cell's observed |IP - SP| held-out peak differences (C3's spread: the cell's own over its
    replicates, or its task's cells' where it has fewer than 2); the multi-agent runs' cliff rate.
    `replicates` may differ from the summary's (e.g. 3 for a one-seed toy matrix rerun with 3 seeds)."""

    replicates: int
    cells: tuple[tuple[str, str, str], ...]
    parallel: tuple[bool, ...]
    spread: tuple[tuple[float, ...], ...]
    cliff_rate: float

    @classmethod
    def from_summary(cls, summary: pd.DataFrame, replicates: int | None = None) -> NullShape:
        runs = summary[(summary["n_evals"] > 0) & (summary["intervention"] == "none")]
        p = _sp_ip_pairs(runs, [*CELL3, *replicate_keys(runs)])
        p["d"] = np.abs(_peak(_side(p, "_ip")).to_numpy() - _peak(_side(p, "_sp")).to_numpy())
        cells = sorted({tuple(k) for k in p[CELL3].itertuples(index=False)})
        spread = []
        for wf, scale, task in cells:
            own = p[(p["workflow"] == wf) & (p["scale"] == scale) & (p["task"] == task)]["d"]
            pool = own if len(own) >= 2 else p[(p["task"] == task) & (p["scale"] == scale)]["d"]
            spread.append(tuple(float(x) for x in pool))
        ma = runs[_ma(runs)]
        return cls(replicates=replicates or n_replicates(runs), cells=tuple(cells),
                   parallel=tuple(parallel_role(c[0]) is not None for c in cells), spread=tuple(spread),
                   cliff_rate=float(ma["cliff"].astype(bool).mean()) if len(ma) else 0.0)  # fmt: skip


NOISES = ("normal", "t3", "signflip")  # how simulate draws C3's IP - SP differences


def simulate(shape: NullShape, rng: np.random.Generator, n_sims: int, *, stay: float = 0.5, icc: float = 0.0,
             shift: float = 0.0, noise: str = "normal", cliff_sp: float | None = None,
             cliff_ip: float | None = None, cliff_parallel: float | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """n_sims matrices of `shape`; with the defaults every validated claim's null holds. Returns arrays
    not_stagnant (S, R, C, 2) bool: each run (sharing 0 SP, 1 IP) escapes stagnation with probability `stay`
        (icc > 0: a replicate's probability is Beta-distributed around `stay` with intraclass correlation icc,
        runs of one replicate sharing it);
    diff (S, R, C): IP - SP peak differences, `shift` plus the cell's spread s_c (the root mean square of its
        observed differences) times N(0, 1) ("normal"), a Student t with 3 df of unit variance ("t3", heavy
        tails), or an observed |difference| of the cell drawn with a random sign ("signflip": bimodal);
    cliff (S, R, C, 2) bool: SP runs cliff with probability cliff_sp, IP runs with cliff_ip (default both
        shape.cliff_rate), IP runs of cells with a parallel role with cliff_parallel (default cliff_ip),
        independently."""
    R, C = shape.replicates, len(shape.cells)
    rate = shape.cliff_rate
    cliff_sp, cliff_ip = rate if cliff_sp is None else cliff_sp, rate if cliff_ip is None else cliff_ip
    rates = np.array([[cliff_sp, cliff_ip if cliff_parallel is None or not par else cliff_parallel]
                      for par in shape.parallel])  # fmt: skip
    p = np.full((n_sims, R, 1, 1), stay)
    if icc > 0:
        a, b = stay * (1 - icc) / icc, (1 - stay) * (1 - icc) / icc
        p = rng.beta(a, b, (n_sims, R, 1, 1))
    scale = np.array([math.sqrt(np.mean(np.square(x))) for x in shape.spread])
    if noise == "normal":
        diff = rng.standard_normal((n_sims, R, C)) * scale
    elif noise == "t3":
        diff = rng.standard_t(3, (n_sims, R, C)) / math.sqrt(3) * scale
    elif noise == "signflip":
        pools = [np.asarray(x) for x in shape.spread]
        mag = np.stack([pools[j][rng.integers(0, len(pools[j]), (n_sims, R))] for j in range(C)], axis=-1)
        diff = (rng.integers(0, 2, (n_sims, R, C)) * 2 - 1) * mag
    else:
        raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
    return {
        "not_stagnant": rng.random((n_sims, R, C, 2)) < p,
        "diff": diff + shift,
        "cliff": rng.random((n_sims, R, C, 2)) < rates,
    }


def rule_on_draws(shape: NullShape, draws: dict[str, np.ndarray], level: float = LEVEL) -> dict[str, tuple]:
    """The validated claims' (value, lo, hi, verdict code) on each simulated matrix: the counts the claims'
    functions take from a summary, then the same interval functions (count_ci, mean_ci_rows, pairs_ci,
    groups_ci) and verdict_codes as claims_table. Each array has shape (S,)."""
    R, C = shape.replicates, len(shape.cells)
    par = np.asarray(shape.parallel, dtype=bool)
    ns, cl = draws["not_stagnant"], draws["cliff"]
    sp, ip = cl[..., 0], cl[..., 1]
    out = {
        "C1": count_ci(ns.sum((1, 2, 3)), R * C * 2, level),
        "C3": mean_ci_rows(draws["diff"].mean(2), level),
        "C4": pairs_ci((ip & ~sp).sum((1, 2)), (~ip & sp).sum((1, 2)), R * C, level),
        "C5": groups_ci(
            ip[:, :, par].sum((1, 2)), R * par.sum(), ip[:, :, ~par].sum((1, 2)), R * (~par).sum(), level
        ),
    }
    claim = {c.cid: c for c in CLAIMS}
    return {k: (*v, verdict_codes(v[1], v[2], claim[k].null, claim[k].direction)) for k, v in out.items()}


def false_verdicts(rule: dict[str, tuple]) -> dict[str, tuple[float, float]]:
    """Per validated claim and "any" (family-wise): (share of simulated matrices with a verdict, its Monte Carlo
    standard error) from rule_on_draws under the null, where every verdict is wrong."""
    codes = {cid: v[3] != 0 for cid, v in rule.items()}
    codes["any"] = np.any(np.stack(list(codes.values())), axis=0)
    return {k: (float(x.mean()), math.sqrt(x.mean() * (1 - x.mean()) / len(x))) for k, x in codes.items()}


# ------------------------------------------------------------------------ coverage of each interval type
# Exact (a sum over every possible outcome) for the intervals of counts, Monte Carlo for the t-interval. The
# mean coverage over the parameter space (uniform; Newcombe 1998's yardstick) is the one to hold within a point
# of nominal; the minimum and the false-verdict rate at the claim's null are listed beside it.

COVERAGE_COLUMNS = ["interval", "used_by", "n", "level", "mean_coverage", "min_coverage", "null_false_max",
                    "mc_se"]  # fmt: skip


def sizes(shape: NullShape) -> dict[str, object]:
    """The sample sizes of the validated claims for a matrix of `shape`: C1 runs, C3 replicates, C4 pairs, C5
    (n1, n2) IP runs with and without a parallel role."""
    R, C, par = shape.replicates, len(shape.cells), int(sum(shape.parallel))
    return {"C1": 2 * R * C, "C3": R, "C4": R * C, "C5": (R * par, R * (C - par))}


def _multinomial(tables: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """P(table) for (T, k) count tables under each of (P, k) cell probabilities: (P, T)."""
    n = int(tables[0].sum())
    lf = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1, dtype=float)))])
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.where(tables[None] > 0, tables[None] * np.log(probs[:, None, :]), 0.0).sum(2)
    return np.exp(lf[n] - lf[tables].sum(1) + logp)


def _rate_rows(name, used, n, level, lo, hi, null=None):
    """Coverage of an interval (lo, hi) for each k = 0..n of a binomial rate."""
    ps = np.linspace(0.0005, 0.9995, 1000)
    pm = binom_pmf(n, ps)
    cov = (pm * ((lo[None] <= ps[:, None] + 1e-12) & (hi[None] >= ps[:, None] - 1e-12))).sum(1)
    false = math.nan if null is None else float((binom_pmf(n, null) * ((lo > null) | (hi < null))).sum())
    return [name, used, str(n), level, float(cov.mean()), float(cov.min()), false, 0.0]


def interval_coverage(shape: NullShape, rng: np.random.Generator, n_sims: int = 200_000,
                      level: float = LEVEL) -> pd.DataFrame:  # fmt: skip
    """COVERAGE_COLUMNS, one row per interval type the claims use (and the paired Newcombe interval C4 used
    before), at the sample sizes of `shape` (sizes) and `level`; Wilson (rate_ci of summary_by_cell's rates)
    at 95% over the replicates of a cell."""
    n = sizes(shape)
    rows = []
    k = np.arange(n["C1"] + 1)
    rows.append(_rate_rows("Clopper-Pearson (exact binomial)", "C1", n["C1"], level,
                           *clopper_pearson(k, n["C1"], level), null=0.5))  # fmt: skip
    r = shape.replicates
    rows.append(_rate_rows("Wilson (stats.rate_ci)", "summary_by_cell rates; inside Newcombe (C5)", r, CI_LEVEL,
                           *wilson_arr(np.arange(r + 1), r, normal_quantile(0.5 + CI_LEVEL / 2))))  # fmt: skip
    # Newcombe, two independent rates: (p1, p2) on a 50 x 50 grid; the null p1 = p2 = p on 999 points
    n1, n2 = n["C5"]
    x1, x2 = np.meshgrid(np.arange(n1 + 1), np.arange(n2 + 1), indexing="ij")
    lo, hi = newcombe_ci(x1, n1, x2, n2, level)
    grid = np.linspace(0.01, 0.99, 50)
    pm1, pm2 = binom_pmf(n1, grid), binom_pmf(n2, grid)
    cov = np.array([[(np.outer(pm1[i], pm2[j]) * ((lo <= a - b + 1e-12) & (hi >= a - b - 1e-12))).sum()
                     for j, b in enumerate(grid)] for i, a in enumerate(grid)])  # fmt: skip
    ps = np.linspace(0.001, 0.999, 999)
    false = [(np.outer(binom_pmf(n1, p), binom_pmf(n2, p)) * ((lo > 0) | (hi < 0))).sum() for p in ps]
    rows.append(["Newcombe, independent (stats.newcombe_ci)", "C5", f"{n1} vs {n2}", level, float(cov.mean()),
                 float(cov.min()), float(max(false)), 0.0])  # fmt: skip
    # paired: every 2 x 2 table (a, b, c, d) of n pairs; 2000 points of the simplex (Dirichlet(1, 1, 1, 1)); the
    # null p10 = p01 = q on 199 points, the concordant mass split 0 / 0.5 / 1 between (1, 1) and (0, 0)
    m = n["C4"]
    tables = np.array([(a, b, c, m - a - b - c) for a in range(m + 1) for b in range(m + 1 - a)
                       for c in range(m + 1 - a - b)])  # fmt: skip
    pts = rng.dirichlet(np.ones(4), 2000)
    qs = np.linspace(0.0025, 0.4975, 199)
    null = np.array([[(1 - 2 * q) * s, q, q, (1 - 2 * q) * (1 - s)] for q in qs for s in (0.0, 0.5, 1.0)])
    prob, prob0 = _multinomial(tables, pts), _multinomial(tables, null)
    delta = pts[:, 1] - pts[:, 2]
    lo, hi = tango_ci(tables[:, 1], tables[:, 2], m, level)
    pairs = {"Tango score, paired (stats.tango_ci)": ("C4", lo, hi)}
    old = np.array([rate_diff_ci([1] * (a + b) + [0] * (c + d), [1] * a + [0] * b + [1] * c + [0] * d, level,
                                 paired=True)[1:3] for a, b, c, d in tables])  # fmt: skip
    pairs["Newcombe, paired (stats.rate_diff_ci)"] = ("C4 before; pooled_interventions", old[:, 0], old[:, 1])
    for name, (used, lo, hi) in pairs.items():
        cov = (prob * ((lo[None] <= delta[:, None] + 1e-12) & (hi[None] >= delta[:, None] - 1e-12))).sum(1)
        false = (prob0 * ((lo > 0) | (hi < 0))[None]).sum(1)
        rows.append([name, used, str(m), level, float(cov.mean()), float(cov.min()), float(false.max()), 0.0])
    # the t-interval over replicates: Monte Carlo, normal values and C3's simulated nulls (simulate's noises)
    x = rng.standard_normal((n_sims, r))
    lo, hi = mean_ci_rows(x, level)[1:]
    cov = float(((lo <= 0) & (hi >= 0)).mean())
    rows.append(["t over replicates (stats.mean_ci)", "C3, normal values", str(r), level, cov, math.nan, 1 - cov,
                 math.sqrt(cov * (1 - cov) / n_sims)])  # fmt: skip
    for noise in NOISES:
        d = simulate(shape, rng, n_sims, noise=noise)["diff"].mean(2)
        lo, hi = mean_ci_rows(d, level)[1:]
        cov = float(((lo <= 0) & (hi >= 0)).mean())
        rows.append(["t over replicates (stats.mean_ci)", f"C3, the evidence's cells, {noise}", str(r), level, cov,
                     math.nan, 1 - cov, math.sqrt(cov * (1 - cov) / n_sims)])  # fmt: skip
    return pd.DataFrame(rows, columns=COVERAGE_COLUMNS)
