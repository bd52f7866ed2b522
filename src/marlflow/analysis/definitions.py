"""Thresholds and the text of the analysis definitions (shown in report.html; copied into the README).

Every number used to flag a run lives here so that code, report and README cannot disagree.
"""

from __future__ import annotations

import math

MIN_GAP = 0.05  # smallest accuracy difference (5 points) counted as real
SE_MULT = 2.0  # ... or this many standard errors of one evaluation, whichever is larger
TOL = 1e-9  # float tolerance for ">=" comparisons against a threshold

LENGTH_GROWTH = 2.0  # capture: supervisory role's eval completion_length grows to >= 2x its first value ...
LENGTH_APPROACH = 0.5  # ... and reaches >= 0.5x the producer role's length at the same eval
FORMAT_RISE = 0.2  # capture: supervisory role's format_failure_rate rises by >= 0.2
MARKER_RISE = 0.2  # capture: fraction of its sampled outputs with a solution marker rises by >= 0.2

# workflow -> (supervisory role that can be captured, producer role that captures it)
SUPERVISOR = {
    "voting": ("aggregator", "generator"),
    "eval_opt": ("evaluator", "generator"),
    "orch_workers": ("orchestrator", "worker"),
}
# workflow -> substrings that mark a solution (not a pick / verdict / plan) in the supervisory role's output
SOLUTION_MARKERS = {
    "voting": ("```",),
    "eval_opt": ("```", "\\boxed{"),
    "orch_workers": ("```", "\\boxed{"),
}


def threshold(se: float) -> float:
    """max(MIN_GAP, SE_MULT * se); MIN_GAP alone when se is unknown (NaN)."""
    if se is None or not math.isfinite(se):
        return MIN_GAP
    return max(MIN_GAP, SE_MULT * float(se))


DEFINITIONS = """\
All accuracies are workflow accuracy on the fixed held-out eval subset (metrics rows split="eval",
role="all", metric="accuracy"), as fractions in [0, 1]; tables in points (x100).

- base: accuracy at eval step 0 (the untrained workflow). NaN if the run has no step-0 eval.
- peak, peak_step: the maximum eval accuracy and the first step that reaches it.
- terminal: accuracy at the last eval. terminal_mean3: mean of the last 3 evals (of all evals if fewer).
- gain_peak = peak - base; gain_terminal = terminal - base.
- se: standard error of one evaluation at peak_step: the accuracy_se row there if logged, else
  sqrt(p (1 - p) / n_eval) with p = peak and n_eval at peak_step (or the run's median n_eval); NaN if neither.
- threshold = max(0.05, 2 se) (0.05 when se is NaN). All ">=" tests allow 1e-9 of float error.
- cliff: peak - terminal >= threshold.
- collapse: terminal < base - threshold (training ended significantly below the untrained workflow).
- stagnation: gain_peak < threshold (no eval ever beat the base by a significant margin).
- capture: the workflow's supervisory role drifts toward its producer role (voting: aggregator vs generator;
  eval_opt: evaluator vs generator; orch_workers: orchestrator vs worker; single: never). Any of, comparing
  the role's first eval (step 0) with its last eval:
  (a) length: completion_length(last) >= 2 x completion_length(first) and
      completion_length(last) >= 0.5 x the producer's completion_length(last);
  (b) format: format_failure_rate(last) - format_failure_rate(first) >= 0.2;
  (c) samples (samples.parquet, when present): the fraction of the role's sampled outputs containing a
      solution marker (voting: a code fence; eval_opt and orch_workers: a code fence or \\boxed{) at the
      last sampled eval step minus that at the first sampled step >= 0.2.
- n_evals: number of eval steps with an accuracy.
- Duplicated metric rows (same run, step, split, role, metric; e.g. after a resume) keep the last one read.

Gradient dynamics, per run x role (metrics rows split="train", role != "all"):
- grad_norm_mean, grad_norm_max: over the run's train steps (NaN steps skipped).
- grad_share_mean; grad_share_early / grad_share_late: mean over the first / last ceil(n/3) train steps of
  the run (n = number of train steps); grad_share_shift = late - early.
- norm_ratio (per run, repeated on each role): largest role grad_norm_mean / smallest role grad_norm_mean.
- dominant: the role with the largest grad_share_mean in the run.
- share_drop_corr: Pearson correlation, over eval intervals (s_prev, s], of the role's mean grad_share on
  train steps in the interval with the accuracy drop acc(s_prev) - acc(s) over it; positive = the more
  gradient mass the role took, the more accuracy fell. NaN with fewer than 3 intervals or a constant series.
  Train step t is the t-th update, so the eval at step s sees updates 1..s.
"""
