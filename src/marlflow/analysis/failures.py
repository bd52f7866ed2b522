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

import numpy as np
import pandas as pd

from marlflow.analysis.curves import wide
from marlflow.core.definitions import (
    ALPHA,
    FORMAT_RISE,
    LENGTH_APPROACH,
    LENGTH_GROWTH,
    MARKER_RISE,
    MIN_GAP,
    TOL,
    Z_CAPTURE,
    supervisor,
)

ROLE_EVAL_METRICS = [
    "completion_length",
    "completion_length_sd",
    "format_failure_rate",
    "solution_marker_share",
    "calls",
]
FAILURE_COLUMNS = ["run_id", "cliff", "collapse", "stagnation", "capture", "evidence"]


def share_rise_test(p0, n0, p1, n1, min_rise: float):
    """One-sided test that a share rose from p0 (over n0 calls) to p1 (over n1): vectorised over any shape.

    Returns (flag, se): flag = rise >= min_rise and rise >= Z_CAPTURE x se, where se is the two-proportion
    test's standard error under "no change" (pooled, Laplace-smoothed share). n <= 0 gives se nan, no flag."""
    p0, n0, p1, n1 = (np.asarray(v, dtype=float) for v in (p0, n0, p1, n1))
    with np.errstate(divide="ignore", invalid="ignore"):
        q = (p0 * n0 + p1 * n1 + 1) / (n0 + n1 + 2)
        se = np.where((n0 > 0) & (n1 > 0), np.sqrt(q * (1 - q) * (1 / n0 + 1 / n1)), np.nan)
    rise = p1 - p0
    return (rise >= min_rise - TOL) & (rise >= Z_CAPTURE * se - TOL), se


def length_rise_test(m0, sd0, n0, m1, sd1, n1, producer1):
    """One-sided test that mean completion length grew from m0 (sd0, n0 calls) to m1 (sd1, n1 calls) by the
    capture rule: m1 >= LENGTH_GROWTH x m0, m1 >= LENGTH_APPROACH x the producer's length, and m1 - m0 >=
    Z_CAPTURE x se. se uses the variance of the two evals' calls pooled into one sample (within and between),
    which is what the difference's variance is if nothing changed. Vectorised; returns (flag, se)."""
    m0, sd0, n0, m1, sd1, n1, producer1 = (
        np.asarray(v, dtype=float) for v in (m0, sd0, n0, m1, sd1, n1, producer1)
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        n = n0 + n1
        var = ((n0 - 1) * sd0**2 + (n1 - 1) * sd1**2 + n0 * n1 / n * (m1 - m0) ** 2) / (n - 1)
        se = np.where((n0 > 0) & (n1 > 0) & (n > 1), np.sqrt(var * (1 / n0 + 1 / n1)), np.nan)
    grew = (m1 >= LENGTH_GROWTH * m0 - TOL) & (m1 >= LENGTH_APPROACH * producer1 - TOL)
    return grew & (m1 - m0 >= Z_CAPTURE * se - TOL), se


def _first_last_rows(s: pd.DataFrame, col: str):
    """The first and last eval rows (by step) where `col` is present, or None (fewer than two such evals)."""
    if col not in s:
        return None
    s = s.dropna(subset=[col]).sort_values("step")
    return (s.iloc[0], s.iloc[-1]) if len(s) >= 2 else None


def _calls(row) -> float:
    v = row.get("calls", math.nan)
    return float(v) if v is not None and math.isfinite(float(v)) else math.nan


def capture_from_metrics(role_evals: pd.DataFrame, workflow: str) -> list[str]:
    """Capture evidence from per-role eval metrics of one run (wide table: step, role, ROLE_EVAL_METRICS);
    empty list if no rule fires. Rules and their calibration: definitions.DEFINITIONS, "Capture"."""
    if supervisor(workflow) is None:
        return []
    sup, prod = supervisor(workflow)
    s = role_evals[role_evals["role"] == sup]
    out = []
    pair = _first_last_rows(s, "completion_length")
    if pair is not None:
        f, last = pair
        first, lst, s0, s1 = (
            float(f["completion_length"]),
            float(last["completion_length"]),
            f["step"],
            last["step"],
        )
        p = role_evals[(role_evals["role"] == prod) & (role_evals["step"] == s1)][
            "completion_length"
        ].dropna()
        prod_last = float(p.iloc[0]) if len(p) else math.nan
        sd0, sd1 = (float(r.get("completion_length_sd", math.nan)) for r in (f, last))
        n0, n1 = _calls(f), _calls(last)
        where = f"(steps {int(s0)} -> {int(s1)}; >= {LENGTH_GROWTH:g}x, {prod} {prod_last:.1f}"
        if all(map(math.isfinite, (sd0, sd1, n0, n1))):
            flag, se = length_rise_test(first, sd0, n0, lst, sd1, n1, prod_last)
            if flag:
                out.append(
                    f"capture: {sup} completion_length {first:.1f} -> {lst:.1f} {where}; rise >= "
                    f"{Z_CAPTURE:.2f} x SE {float(se):.2f})"
                )
        elif lst >= LENGTH_GROWTH * first - TOL and lst >= LENGTH_APPROACH * prod_last - TOL:
            # logged before completion_length_sd existed: the effect-size rule alone (nan never passes)
            out.append(
                f"capture: {sup} completion_length {first:.1f} -> {lst:.1f} {where}; uncalibrated: "
                "no completion_length_sd or calls logged)"
            )
    for col in ("format_failure_rate", "solution_marker_share"):
        pair = _first_last_rows(s, col)
        if pair is None:
            continue
        f, last = pair
        p0, p1, n0, n1 = float(f[col]), float(last[col]), _calls(f), _calls(last)
        steps = f"steps {int(f['step'])} -> {int(last['step'])}"
        min_rise = FORMAT_RISE if col == "format_failure_rate" else MARKER_RISE
        if math.isfinite(n0) and math.isfinite(n1):
            flag, se = share_rise_test(p0, n0, p1, n1, min_rise)
            if flag:
                out.append(
                    f"capture: {sup} {col} {p0:.2f} -> {p1:.2f} ({steps}, {int(n0)} / {int(n1)} calls, rise "
                    f"{p1 - p0:.2f} >= max({min_rise:g}, {Z_CAPTURE:.2f} x SE {float(se):.3f}))"
                )
        elif p1 - p0 >= min_rise - TOL:  # no call counts logged: the effect-size rule alone
            out.append(f"capture: {sup} {col} {p0:.2f} -> {p1:.2f} ({steps}; uncalibrated: no calls logged)")
    return out


def run_signatures(row: dict, role_evals: pd.DataFrame) -> dict:
    """Failure flags and evidence for one summary row (a dict of SUMMARY_COLUMNS)."""
    ev: list[str] = []
    peak, base = row["peak"], row["base"]
    if row["n_evals"] == 0:
        ev.append("no eval accuracy")
    else:
        if row["cliff"]:
            # the union bound's size (stats._cliff_union): K - 2 candidates after a base, else K - 1
            z = NormalDist().inv_cdf(1 - ALPHA / max(row["n_evals"] - 1 - (not math.isnan(base)), 1))
            ev.append(
                f"cliff: drop {row['drop']:.3f} from an improved eval to the mean of the (<= 3) evals after it >= "
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
