"""Every rule and threshold the analysis uses, and their text (shown in report.html; docs/reference.md
copies it).

Numbers live here so that code, report and docs/reference.md cannot disagree. The estimators that apply them
are in `marlflow.core.stats` (cliff / collapse / stagnation tests, seed CIs); the capture marker test is
`solution_marker` below.

Why the cliff test looks the way it does (tests/test_calibration.py checks it by simulation): taking the
maximum of K noisy evaluations as "the peak" and comparing it with one final evaluation flags about 21% of
flat runs at n=200, K=5 (60% at K=51). Here the terminal is the mean of the last 3 evals, each candidate
peak's difference from it is compared with the standard error of that *difference*, and the critical value
grows with the number of candidates K (union bound), so the max over K is paid for. The peak *estimate*
used for gains (peak_confirmed) is cross-fitted on two halves of the eval set.
"""

from __future__ import annotations

import math
import re
from statistics import NormalDist

from marlflow.core.workflow_spec import spec_of

MIN_GAP = 0.05  # smallest accuracy difference (5 points) ever counted as real
# One-sided level of the cliff, collapse and stagnation tests. The cliff and stagnation tests take the best
# of several candidate peak evals, so each candidate is tested at ALPHA / (number of candidates) (union
# bound). Simulated false-cliff rate for flat accuracy (tests/test_calibration.py): <= 5% over p in
# {0.3, 0.5, 0.8}, n in {32, 200, 1412}, K in {5, 51}.
ALPHA = 0.04
Z = NormalDist().inv_cdf(1 - ALPHA)  # 1.751: one-sided critical value where nothing is selected
SE_MULT = 2.0  # legacy rule max(0.05, 2 se) of one evaluation; kept only for `threshold` (tables caption)
TERMINAL_WINDOW = 3  # terminal estimate = mean of the last 3 evals
TOL = 1e-9  # float tolerance for ">=" comparisons against a threshold
# The band a toy run's base (step-0) accuracy is designed to fall in: low enough that RL has room to gain,
# high enough that a group of G=8 samples has correct answers to learn from. A rebuilt toy model (another CPU,
# torch version or thread count: marlflow.models.toybuild, "Determinism") can land outside it; the report says so.
TOY_BASE_BAND = (0.15, 0.70)
CI_LEVEL = 0.95  # confidence level of every CI across seeds

LENGTH_GROWTH = 2.0  # capture: supervisory role's eval completion_length grows to >= 2x its first value ...
LENGTH_APPROACH = 0.5  # ... and reaches >= 0.5x the producer role's length at the same eval
FORMAT_RISE = 0.2  # capture: supervisory role's format_failure_rate rises by >= 0.2
MARKER_RISE = 0.2  # capture: share of its eval outputs with a solution marker rises by >= 0.2 (and >= Z SE)
# Capture is any of three rules, each a one-sided test at ALPHA / 3, so a stationary role is flagged with
# probability <= ALPHA (union bound); simulated in tests/test_calibration.py.
Z_CAPTURE = NormalDist().inv_cdf(1 - ALPHA / 3)  # 2.216

CODE_FENCE = "```"


def threshold(se: float) -> float:
    """max(MIN_GAP, SE_MULT * se); MIN_GAP alone when se is unknown (NaN). The legacy single-eval rule."""
    if se is None or not math.isfinite(se):
        return MIN_GAP
    return max(MIN_GAP, SE_MULT * float(se))


def boxed_contents(text: str) -> list[str]:
    """The contents of every \\boxed{...} in `text`, braces matched (an unclosed one runs to the end)."""
    out, start = [], 0
    while (i := text.find("\\boxed{", start)) >= 0:
        depth, j = 1, i + len("\\boxed{")
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        out.append(text[i + len("\\boxed{") : j - 1 if depth == 0 else j])
        start = j
    return out


def supervisor(workflow: str) -> tuple[str, str] | None:
    """(supervisory role that can be captured, producer role that captures it) of a workflow, from its
    WorkflowSpec (marlflow.core.workflow_spec); None when no role supervises another (single)."""
    return spec_of(workflow).supervisor


def parallel_role(workflow: str) -> str | None:
    """The role whose calls run in parallel in one episode (their gradients' amplification is claim C6), from
    the workflow's spec; None when it has none."""
    return spec_of(workflow).parallel_role


def solution_marker(workflow: str, text: str) -> bool:
    """True if a supervisory role's output contains a solution: a code fence, or a \\boxed{...} whose
    content is not the role's own valid answer (the spec's own_boxed: Eval-Opt's `\\boxed{Correct}` and
    Voting's `\\boxed{2}` are not solutions). False for workflows without a supervisory role."""
    spec = spec_of(workflow)
    if spec.supervisor is None:
        return False
    if CODE_FENCE in text:
        return True
    own = spec.own_boxed
    return any(own is None or not re.fullmatch(own, c) for c in boxed_contents(text))


DEFINITIONS = """\
All accuracies are workflow accuracy on the fixed held-out eval subset (metrics rows split="eval",
role="all", metric="accuracy"), as fractions in [0, 1]; tables in points (x100). The eval subset is split
into two fixed halves by problem index (even: half a, odd: half b); evaluate() logs accuracy_a / accuracy_b
and n_eval_a / n_eval_b.

Per run (summary.csv):
- base: accuracy at eval step 0 (the untrained workflow). NaN if the run has no step-0 eval.
- peak, peak_step: the maximum eval accuracy and the first step reaching it (as the paper tabulates it;
  biased upward by the max over K evals, so no test uses it).
- terminal: accuracy at the last eval. terminal_mean3: mean of the last 3 evals (all, if fewer).
- peak_confirmed: the cross-fitted peak estimate: the step with the best accuracy on half a, read on half b,
  and the step with the best accuracy on half b, read on half a, averaged with weights n_b/n and n_a/n. The
  half that picks a step never scores it, so the max over K evals does not inflate it (peak does). NaN
  without half accuracies (runs logged before they existed).
- peak_heldout, peak_heldout_step: the step with the best accuracy on the validation problems (metrics rows
  split="val": task.val_size problems disjoint from the test and training problems, marlflow.tasks.splits;
  step 0 included, first on ties), and the test accuracy at that step. No test outcome selects it, so it is
  the peak estimate for gains where a run has validation evaluations (gain_heldout = peak_heldout - base);
  NaN without them. peak_confirmed is the second view.
- gain_peak = peak - base; gain_confirmed = peak_confirmed - base; gain_terminal = terminal - base;
  gain_terminal3 = terminal_mean3 - base.
- Variances: each eval's accuracy is treated as an independent binomial mean with variance v/n_k,
  v = max(q_k (1 - q_k), q (1 - q)), q_k = (x_k + 1)/(n_k + 2) at that eval (x_k correct of n_k) and q the
  same over all of the run's evals (so a selected high or low eval does not shrink its own variance). Evals
  reuse the same problems and sampling seed, so in practice they are positively correlated and the variance
  of a difference is smaller than this: the tests are conservative.
- Tests at one-sided level alpha = 0.04. cliff: the candidate peaks are the evals k after step 0 and before
  the last that improved on the base (acc_k > base; a run that never rose has no peak to fall from: a
  collapse, not a cliff); d_k = acc_k - (mean of the last min(3, K-1-k) evals, all after k) with its SE;
  cliff if any d_k >= max(0.05, z SE_k) with z = Phi^-1(1 - alpha/(K-2)), K evals (union bound: flat
  accuracy is flagged with probability <= alpha; simulated <= 4.1% for p in {0.3, 0.5, 0.8}, n in
  {32, 200, 1412}, K in {5, 13, 51}). Power at n = 200 (a 15-point rise from the base, then a 12-point drop;
  tests/calibrate_flags.py): drop over the last 3 evals 77-88% at K = 5, >= 98.8% at K = 13 and 51;
  drop at the last eval only 69-82% at K = 5, 60-71% at K = 13, 50-61% at K = 51; at n = 32 under 48%.
  drop, drop_se: d_k and SE_k of the candidate that passes by the most (or misses by the least); NaN
  without a candidate.
- collapse: base - terminal_mean3 >= max(0.05, z SE), z = Phi^-1(1 - alpha) = 1.75 (nothing is selected).
- stagnation: no eval k >= 1 has acc_k - base >= max(0.05, z_{K-1} SE_k) (union bound over K - 1).
- se: standard error of the single evaluation at peak_step, sqrt(p (1 - p) / n_eval) (accuracy_se if logged).
- n_evals: number of eval steps with an accuracy. All ">=" tests allow 1e-9 of float error. Duplicated metric
  rows (same run, step, split, role, metric; e.g. after a resume) keep the last one read.

Capture (a supervisory role drifts toward the role it supervises: voting aggregator vs generator, eval_opt
evaluator vs generator, orch_workers orchestrator vs worker; single: never), comparing the role's first eval
(step 0) with its last eval, any of:
  (a) length: completion_length(last) >= 2 x completion_length(first) and >= 0.5 x the producer's
      completion_length(last), and the rise >= Z_CAPTURE x SE, SE from the pooled variance of the two evals'
      calls (completion_length_sd, n = calls; the pooled sample's variance including the between-eval term,
      as a permutation test's). Runs logged before completion_length_sd existed get the effect-size rule
      alone, and their evidence says "uncalibrated";
  (b) format: format_failure_rate(last) - format_failure_rate(first) >= 0.2 and >= Z_CAPTURE x SE;
  (c) solution markers: solution_marker_share(last) - solution_marker_share(first) >= 0.2 and >= Z_CAPTURE x SE.
      For (b) and (c), SE is the two-proportion test's under "no change": pooled share q = (x0 + x1 + 1) /
      (n0 + n1 + 2) (Laplace-smoothed), SE = sqrt(q (1 - q) (1/n0 + 1/n1)), n = the role's eval calls.
      Z_CAPTURE = Phi^-1(1 - alpha/3) = 2.22: each rule at alpha/3, so a role whose behaviour does not change
      is flagged with probability <= alpha = 4% (union bound; simulated false-capture rates in
      docs/reference.md, tests/test_calibration.py). solution_marker_share is computed in
      evaluate() over all of the role's eval calls: the share of outputs with a code fence or a \\boxed{...}
      that is not the role's own valid answer (voting: \\boxed{N}; eval_opt: \\boxed{Correct/Incorrect};
      orch_workers: none, every \\boxed{} is a solution).

Across replicates (summary_by_cell, contrasts; cell = workflow, sharing, scale, task, intervention; a
replicate = a seed, or a (seed, toy build) pair where runs carry the build axis; n_seeds counts replicates):
- mean and 95% CI over replicates, t-interval mean +- t_{0.975, s-1} sd / sqrt(s) (s replicates); with one
  the CI is n/a. cliff_rate / collapse_rate / stagnation_rate = share of replicates with the flag, CI = Wilson
  score interval (inside [0, 1]; 0 of 3 gives [0, 0.56]). The paired cliff difference's t-interval is cut to [-1, 1].
- Peaks in these tables, the peak / terminal table, the findings and the claims: peak_heldout (else
  peak_confirmed where runs have no validation set); never the in-sample peak.
- sp-ip: per (workflow, scale, task, intervention) the per-replicate difference SP - IP (same seed = same
  problems at every step), then mean and CI over replicates. ma-sa: each workflow x sharing minus `single`
  (sp) at the same scale, task, intervention and replicate. itv-none: each intervention minus none in the
  same cell and replicate. interventions.csv pools each intervention's pairs over cells as the preset
  declares it (matrix.yaml analysis.interventions), intervals corrected over the compared interventions.

Gradient metrics (trainer.update, per train step; one meaning under SP and IP):
- g_r: role r's part of its policy's gradient (its calls' loss terms in the policy's batch loss).
  grad_norm = ||g_r|| / f_r, the gradient norm of the role's own mean loss (f_r = the role's share of the
  policy's loss normaliser: calls for grpo/dr_grpo, tokens for bnpo/dapo; 1 under IP); the same number
  under SP and IP for the same calls.
- grad_contrib_pre = ||g_r||; grad_contrib_post = clip_coef x ||g_r||, its part of the applied (clipped)
  update; clip_coef = min(1, max_grad_norm / (||g_policy|| + 1e-6)), per policy, logged on its roles.
- grad_share = grad_contrib_post / sum over all roles of grad_contrib_post (share of applied-update norm).
- proj_share = <g_r, g_policy> / ||g_policy||^2; sums to 1 over the roles of one policy (IP: always 1),
  and counts cancellation between roles (a role pulling against the others has a negative share).
- cos_others (SP, >= 2 roles in the policy): cosine of g_r with the sum of the policy's other roles.
- slot_amplification (a role with >= 2 non-zero slots, e.g. voting's generator0..2, orch_workers' workers):
  ||sum_i g_i|| / sqrt(sum_i ||g_i||^2) over its slots' gradients; 1 = orthogonal, sqrt(m) = identical.
  slot_cos: mean pairwise cosine of those slot gradients.
- ema_cos: cosine of the role's own-loss gradient with its exponential moving average over earlier steps
  (weight 1/W per step, W = grad_ema_window, default 128; steps with a zero gradient do not update it);
  drift = 1 - ema_cos. The EMA is checkpointed, so resumed runs log the same values.

Gradient dynamics per run x role (grad_dynamics.csv): grad_norm_mean/max; grad_share_mean; share
early/late = mean over the first / last ceil(n/3) train steps, shift = late - early; norm_ratio = largest /
smallest role grad_norm_mean; dominant = the role with the largest proj_share mean (grad_share if
proj_share is absent); share_drop_corr = Pearson correlation over eval intervals (s_prev, s] of the role's
mean grad_share with acc(s_prev) - acc(s); means of proj_share, cos_others, slot_amplification, slot_cos,
ema_cos and clip_coef; drift_corr (dominant role under SP only) = Pearson correlation over train steps of
its proj_share with the mean drift of the policy's other roles.
"""
