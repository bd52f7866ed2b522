"""Failure signatures per run: cliff, collapse, stagnation, capture, with a short evidence text.

    failures = failure_signatures(metrics, summary, samples)   # FAILURE_COLUMNS, one row per run

With thr = max(0.05, 2 se) (definitions.threshold): cliff = peak - terminal >= thr; collapse = terminal <
base - thr; stagnation = gain_peak < thr; capture = the workflow's supervisory role (voting aggregator,
eval_opt evaluator, orch_workers orchestrator) drifts toward its producer role by length, format failures or
solution markers in its sampled outputs (exact rule in definitions.DEFINITIONS).
"""

from __future__ import annotations

import math

import pandas as pd

from marlflow.analysis.curves import wide
from marlflow.analysis.definitions import (
    FORMAT_RISE,
    LENGTH_APPROACH,
    LENGTH_GROWTH,
    MARKER_RISE,
    SOLUTION_MARKERS,
    SUPERVISOR,
    TOL,
    threshold,
)

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
    return out


def marker_fraction(outputs: pd.Series, markers: tuple[str, ...]) -> float:
    """Fraction of outputs that contain any of `markers`."""
    if outputs.empty:
        return math.nan
    return float(outputs.map(lambda o: any(m in o for m in markers)).mean())


def capture_from_samples(samples: pd.DataFrame, workflow: str) -> list[str]:
    """Capture evidence from one run's samples: the supervisory role's share of outputs with a solution marker
    at the last sampled eval step minus at the first >= MARKER_RISE."""
    if workflow not in SUPERVISOR or samples.empty:
        return []
    sup = SUPERVISOR[workflow][0]
    markers = SOLUTION_MARKERS[workflow]
    s = samples[samples["role"] == sup]
    steps = sorted(s["step"].unique())
    if len(steps) < 2:
        return []
    first = s[s["step"] == steps[0]]["output"]
    last = s[s["step"] == steps[-1]]["output"]
    f0, f1 = marker_fraction(first, markers), marker_fraction(last, markers)
    if f1 - f0 >= MARKER_RISE - TOL:
        n0 = round(f0 * len(first))
        n1 = round(f1 * len(last))
        return [
            f"capture: {sup} outputs with {'/'.join(markers)} {n0}/{len(first)} -> {n1}/{len(last)} "
            f"(steps {steps[0]} -> {steps[-1]})"
        ]
    return []


def run_signatures(row: dict, role_evals: pd.DataFrame, samples: pd.DataFrame) -> dict:
    """Failure flags and evidence for one summary row (a dict of SUMMARY_COLUMNS)."""
    ev: list[str] = []
    thr = threshold(row["se"])
    peak, terminal, base = row["peak"], row["terminal"], row["base"]
    cliff = collapse = stagnation = False
    if row["n_evals"] == 0:
        ev.append("no eval accuracy")
    else:
        drop = peak - terminal
        cliff = bool(row["cliff"])  # computed once, in curves.summarize_curve
        if cliff:
            ev.append(
                f"cliff: peak {peak:.3f} at step {row['peak_step']}, terminal {terminal:.3f} "
                f"(drop {drop:.3f} >= {thr:.3f})"
            )
        if math.isnan(base):
            ev.append("no step-0 eval (collapse, stagnation undefined)")
        else:
            collapse = bool(terminal < base - thr - TOL)
            if collapse:
                ev.append(f"collapse: terminal {terminal:.3f} < base {base:.3f} - {thr:.3f}")
            stagnation = bool(peak - base < thr - TOL)
            if stagnation:
                ev.append(f"stagnation: gain_peak {peak - base:.3f} < {thr:.3f}")
    cap = capture_from_metrics(role_evals, row["workflow"]) + capture_from_samples(samples, row["workflow"])
    return dict(
        run_id=row["run_id"],
        cliff=cliff,
        collapse=collapse,
        stagnation=stagnation,
        capture=bool(cap),
        evidence="; ".join(ev + cap),
    )


def failure_signatures(
    metrics: pd.DataFrame, summary: pd.DataFrame, samples: pd.DataFrame | None = None
) -> pd.DataFrame:
    """One row per run of `summary` (FAILURE_COLUMNS), sorted by run_id; `samples` may be None or empty."""
    roles = wide(metrics, "eval", None, ["completion_length", "format_failure_rate"])
    roles = roles[roles["role"] != "all"]
    roles_by_run = dict(tuple(roles.groupby("run_id", sort=True)))
    if samples is None or samples.empty:
        samples_by_run = {}
    else:
        samples_by_run = dict(tuple(samples.groupby("run_id", sort=True)))
    records = []
    for row in summary.sort_values("run_id").to_dict("records"):
        rid = row["run_id"]
        records.append(
            run_signatures(
                row, roles_by_run.get(rid, roles.iloc[0:0]), samples_by_run.get(rid, pd.DataFrame())
            )
        )
    out = pd.DataFrame.from_records(records, columns=FAILURE_COLUMNS)
    for c in ("cliff", "collapse", "stagnation"):
        out[c] = out[c].astype(bool)
    out["capture"] = out["capture"].astype(bool)
    return out
