"""Failure signatures per run: cliff, collapse, stagnation, capture, with a short evidence text.

    failures = failure_signatures(metrics, summary)   # FAILURE_COLUMNS, one row per run

Cliff, collapse and stagnation come from the summary (curves.summarize_runs, calibrated tests in
stats.curve_tests). Capture: the workflow's supervisory role (voting aggregator, eval_opt evaluator,
orch_workers orchestrator) drifts toward its producer role by length, format failures or the share of its
eval outputs that contain a solution (solution_marker_share, computed in evaluate() over every eval call).
Exact rules: definitions.DEFINITIONS.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pandas as pd

from marlflow.analysis.curves import wide
from marlflow.analysis.definitions import (
    ALPHA,
    FORMAT_RISE,
    LENGTH_APPROACH,
    LENGTH_GROWTH,
    MARKER_RISE,
    MIN_GAP,
    SUPERVISOR,
    TOL,
    Z,
)

ROLE_EVAL_METRICS = ["completion_length", "format_failure_rate", "solution_marker_share", "calls"]
FAILURE_COLUMNS = ["run_id", "cliff", "collapse", "stagnation", "capture", "evidence"]


def _first_last(series: pd.DataFrame, col: str) -> tuple[float, float, int, int] | None:
    """(first, last, first_step, last_step) of a column over eval steps where it is present, or None."""
    s = series[["step", col]].dropna().sort_values("step")
    if s.empty:
        return None
    return float(s[col].iloc[0]), float(s[col].iloc[-1]), int(s["step"].iloc[0]), int(s["step"].iloc[-1])


def capture_from_metrics(role_evals: pd.DataFrame, workflow: str) -> list[str]:
    """Capture evidence from per-role eval metrics of one run (wide table: step, role, completion_length,
    format_failure_rate); empty list if no rule fires."""
    if workflow not in SUPERVISOR:
        return []
    sup, prod = SUPERVISOR[workflow]
    s = role_evals[role_evals["role"] == sup]
    out = []
    length = _first_last(s, "completion_length")
    if length is not None:
        first, last, s0, s1 = length
        p = role_evals[(role_evals["role"] == prod) & (role_evals["step"] == s1)][
            "completion_length"
        ].dropna()
        prod_last = float(p.iloc[0]) if len(p) else math.nan
        if (
            s1 > s0
            and last >= LENGTH_GROWTH * first - TOL
            and math.isfinite(prod_last)
            and last >= LENGTH_APPROACH * prod_last - TOL
        ):
            out.append(
                f"capture: {sup} completion_length {first:.1f} -> {last:.1f} (steps {s0} -> {s1}; "
                f">= {LENGTH_GROWTH:g}x, {prod} {prod_last:.1f})"
            )
    fmt = _first_last(s, "format_failure_rate")
    if fmt is not None:
        first, last, s0, s1 = fmt
        if s1 > s0 and last - first >= FORMAT_RISE - TOL:
            out.append(f"capture: {sup} format_failure_rate {first:.2f} -> {last:.2f} (steps {s0} -> {s1})")
    marker = marker_rise(s)
    if marker is not None:
        out.append(marker)
    return out


def marker_rise(sup_evals: pd.DataFrame) -> str | None:
    """Evidence if the supervisory role's solution_marker_share rose from its first to its last eval by
    >= MARKER_RISE and by >= Z standard errors of the difference of two binomial shares (n = calls)."""
    if "solution_marker_share" not in sup_evals:
        return None
    s = sup_evals[["step", "solution_marker_share", "calls"]].dropna(subset=["solution_marker_share"])
    s = s.sort_values("step")
    if len(s) < 2:
        return None
    f, last = s.iloc[0], s.iloc[-1]
    p0, p1 = float(f["solution_marker_share"]), float(last["solution_marker_share"])
    n0, n1 = float(f["calls"]), float(last["calls"])
    se = math.sqrt(_shr_var(p0, n0) + _shr_var(p1, n1)) if n0 > 0 and n1 > 0 else math.nan
    rise = p1 - p0
    if rise >= MARKER_RISE - TOL and math.isfinite(se) and rise >= Z * se - TOL:
        return (
            f"capture: {sup_evals['role'].iloc[0]} solution_marker_share {p0:.2f} -> {p1:.2f} "
            f"(steps {int(f['step'])} -> {int(last['step'])}, {int(n0)} / {int(n1)} calls, rise {rise:.2f} "
            f">= max({MARKER_RISE:g}, {Z:g} x SE {se:.3f}))"
        )
    return None


def _shr_var(p: float, n: float) -> float:
    q = (p * n + 1) / (n + 2)  # Laplace-smoothed, so a share of 0 or 1 still has a variance
    return q * (1 - q) / n


def run_signatures(row: dict, role_evals: pd.DataFrame) -> dict:
    """Failure flags and evidence for one summary row (a dict of SUMMARY_COLUMNS)."""
    ev: list[str] = []
    peak, base = row["peak"], row["base"]
    if row["n_evals"] == 0:
        ev.append("no eval accuracy")
    else:
        if row["cliff"]:
            z = NormalDist().inv_cdf(1 - ALPHA / max(row["n_evals"] - 1, 1))
            ev.append(
                f"cliff: drop {row['drop']:.3f} from an eval to the mean of the (<= 3) evals after it >= "
                f"max({MIN_GAP:g}, {z:.2f} x SE {row['drop_se']:.3f}) (max {peak:.3f} at step "
                f"{row['peak_step']}, terminal_mean3 {row['terminal_mean3']:.3f})"
            )
        if math.isnan(base):
            ev.append("no step-0 eval (collapse, stagnation undefined)")
        else:
            if row["collapse"]:
                ev.append(f"collapse: terminal_mean3 {row['terminal_mean3']:.3f} below base {base:.3f}")
            if row["stagnation"]:
                ev.append(f"stagnation: no eval significantly above base {base:.3f} (max {peak:.3f})")
    cap = capture_from_metrics(role_evals, row["workflow"])
    return dict(
        run_id=row["run_id"],
        cliff=bool(row["cliff"]),
        collapse=bool(row["collapse"]),
        stagnation=bool(row["stagnation"]),
        capture=bool(cap),
        evidence="; ".join(ev + cap),
    )


def failure_signatures(metrics: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """One row per run of `summary` (FAILURE_COLUMNS), sorted by run_id."""
    roles = wide(metrics, "eval", None, ROLE_EVAL_METRICS)
    roles = roles[roles["role"] != "all"]
    roles_by_run = dict(tuple(roles.groupby("run_id", sort=True)))
    records = [
        run_signatures(row, roles_by_run.get(row["run_id"], roles.iloc[0:0]))
        for row in summary.sort_values("run_id").to_dict("records")
    ]
    out = pd.DataFrame.from_records(records, columns=FAILURE_COLUMNS)
    for c in ("cliff", "collapse", "stagnation", "capture"):
        out[c] = out[c].astype(bool)
    return out
