"""Paired inference on per-problem outcomes: two arms scored on the same problems, over replicates.

    d, lo, hi, p = paired_diff(a, b, level)          # a, b: (R, P) outcomes, R replicates x P problems
    p = mcnemar_exact(n10, n01, alternative="greater")

Every evaluation scores the same fixed problems (marlflow.tasks.splits), so two runs of a cell (SP and IP, an
intervention and none) or two evaluations of one run (its peak and its terminal) are paired by problem: a
problem one arm solves the other tends to solve too. Intervals that treat the two accuracies as independent
binomials ignore that correlation (too wide), and intervals over replicates alone ignore that every replicate
shares the same problems (too narrow for a claim about problems in general).

`paired_diff` estimates the mean difference over replicates and problems and gives it a variance with both
crossed components, problems (shared by every replicate) and replicates (seeds / builds):

    V = s2_problem / P + s2_replicate / R,   t with Welch-Satterthwaite degrees of freedom (R - 1 at 2-3 replicates)

where s2_problem is the variance over problems of the per-problem mean difference (averaged over replicates)
and s2_replicate the variance over replicates of the per-replicate mean difference. Each term alone is the
paired t-interval's variance of a one-way design; their sum counts the problem x replicate noise twice (the
interval is a little wide where seeds do not matter). Satterthwaite's degrees of freedom covered 89% at 2
replicates and 93% at 3 with a large seed effect, so 2-3 replicates take R - 1 (conservative: coverage near
100%, little power; FEW_REPLICATES). Measured 95% coverage under the null and power
(benchmarks/stats/paired_coverage.py, 10,000 simulations per row, P = 200; RESULTS.md "Paired statistics"):
within a point of nominal or above it at one replicate and at 6 (toy_seeds' 3 seeds x 2 builds). The residual
subtracted instead (unbiased) covered 92% at 3 replicates. With one replicate it is the paired t-interval
over problems (for 0/1 outcomes McNemar's normal interval), which covers the problems but says nothing about
seed variance.

`mcnemar_exact`: the exact (conditional binomial) McNemar test on discordant pairs; pooled over replicates
(discordant counts summed) it is the stratified exact test, valid under the null that within every
(replicate, problem) pair the two outcomes are exchangeable.
"""

from __future__ import annotations

import math

import numpy as np

from marlflow.core.stats import t_quantile

FEW_REPLICATES = (
    4  # below this many replicates (but more than one) the interval takes R - 1 degrees of freedom
)


def _binom_tail_ge(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exact (log-space sums, fine for n up to ~10^6)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2.0)
            for i in range(k, n + 1)]  # fmt: skip
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def mcnemar_exact(n10: int, n01: int, alternative: str = "two-sided") -> float:
    """Exact McNemar p-value from the discordant counts: n10 pairs where arm a is right and b wrong, n01 the
    reverse. alternative "greater" (a better than b), "less", or "two-sided" (twice the smaller tail, at most
    1). No discordant pairs: p = 1."""
    n10, n01 = int(n10), int(n01)
    n = n10 + n01
    if n == 0:
        return 1.0
    if alternative == "greater":
        return _binom_tail_ge(n10, n)
    if alternative == "less":
        return _binom_tail_ge(n01, n)
    if alternative != "two-sided":
        raise ValueError(f"alternative must be 'greater', 'less' or 'two-sided', got {alternative!r}")
    return min(1.0, 2.0 * _binom_tail_ge(max(n10, n01), n))


def paired_diff(a, b, level: float = 0.95) -> dict:
    """Mean of a - b over replicates and problems, its interval at `level` and the stratified exact McNemar
    p-value (two-sided; 0/1 outcomes only, else NaN).

    a, b: (R, P) arrays (or (P,) for one replicate) of per-problem outcomes, row r of both from replicate r,
    column p from problem p (same order in both). Returns {diff, lo, hi, se, df, p, n_rep, n_prob, n10, n01,
    corr}: corr is the correlation of the two arms' outcomes over (replicate, problem) pairs (how much pairing
    gains); lo/hi NaN when neither variance term can be estimated."""
    a = np.atleast_2d(np.asarray(a, dtype=float))
    b = np.atleast_2d(np.asarray(b, dtype=float))
    if a.shape != b.shape:
        raise ValueError(
            f"paired arms must have the same (replicates, problems) shape, got {a.shape} and {b.shape}"
        )
    r, p = a.shape
    d = a - b
    diff = float(d.mean())
    terms = []  # (variance term, its degrees of freedom)
    if p > 1:
        terms.append((float(np.var(d.mean(axis=0), ddof=1)) / p, p - 1))
    if r > 1:
        terms.append((float(np.var(d.mean(axis=1), ddof=1)) / r, r - 1))
    var = sum(t for t, _ in terms)
    if not terms:
        se, df, lo, hi = math.nan, math.nan, math.nan, math.nan
    elif var <= 0.0:  # every pair agrees: no variance, the interval is the point (the exact p-value speaks)
        se, df, lo, hi = 0.0, float(min(k for _, k in terms)), diff, diff
    else:
        df = var**2 / sum(t**2 / k for t, k in terms if t > 0)  # Welch-Satterthwaite
        if (
            1 < r < FEW_REPLICATES
        ):  # too few replicates for Satterthwaite to hold the level (module docstring)
            df = float(r - 1)
        se = math.sqrt(var)
        half = t_quantile(1 - (1 - level) / 2, max(1, int(df))) * se
        lo, hi = max(-1.0, diff - half), min(1.0, diff + half)
    binary = bool(np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all())
    n10, n01 = (int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())) if binary else (0, 0)
    sa, sb = a.std(), b.std()
    corr = float(((a - a.mean()) * (b - b.mean())).mean() / (sa * sb)) if sa > 0 and sb > 0 else math.nan
    return {
        "diff": diff, "lo": lo, "hi": hi, "se": se, "df": df,
        "p": mcnemar_exact(n10, n01) if binary else math.nan,
        "n_rep": r, "n_prob": p, "n10": n10, "n01": n01, "corr": corr,
    }  # fmt: skip
