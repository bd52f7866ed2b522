"""The statistics behind every flag and CI: calibrated curve tests and confidence intervals over seeds.

    r = curve_tests(acc, n, acc_a, acc_b, n_a, n_b)   # arrays (R, K): R runs x K evals, vectorised
    r["cliff"], r["drop"], r["drop_se"], r["peak_confirmed"], r["collapse"], r["stagnation"]
    r = curve_tests(acc, n)                            # no half accuracies: Bonferroni fallback
    mean, lo, hi, s = mean_ci([0.61, 0.58, 0.66])      # t-interval over seeds; lo, hi NaN for one value

The rules and constants are in `marlflow.core.definitions` (DEFINITIONS explains each). Pure numpy and
the standard library (no scipy): t quantiles invert the exact t CDF for integer degrees of freedom.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from statistics import NormalDist

import numpy as np

from marlflow.core.definitions import ALPHA, CI_LEVEL, MIN_GAP, TERMINAL_WINDOW, TOL


def normal_quantile(q: float) -> float:
    return NormalDist().inv_cdf(q)


def t_two_sided(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer df >= 1 (Abramowitz & Stegun 26.7.3-4, exact)."""
    th = math.atan(abs(t) / math.sqrt(df))
    c2, term, acc = math.cos(th) ** 2, 1.0, 1.0
    if df % 2:  # odd: (2/pi) (theta + sin cos (1 + 2/3 cos^2 + ...)), series up to cos^(df-3)
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            acc += term
        return (2 / math.pi) * (th + (math.sin(th) * math.cos(th) * acc if df > 1 else 0.0))
    for k in range(1, df // 2):  # even: sin (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ...), up to cos^(df-2)
        term *= c2 * (2 * k - 1) / (2 * k)
        acc += term
    return math.sin(th) * acc


def t_quantile(q: float, df: int) -> float:
    """Quantile q (0.5 < q < 1) of Student's t with integer df >= 1, by bisection on the exact CDF."""
    if df < 1 or not 0.5 < q < 1:
        raise ValueError(f"t quantile needs df >= 1 and 0.5 < q < 1, got df={df}, q={q}")
    target = 2 * q - 1
    lo, hi = 0.0, 1.0
    while t_two_sided(hi, df) < target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_two_sided(mid, df) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


def _finite(values: Iterable[float]) -> tuple[np.ndarray, float, int]:
    """(the finite values, their mean or NaN if none, how many)."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(float(v))], dtype=float)
    return x, (float(x.mean()) if len(x) else math.nan), len(x)


def mean_ci(values: Iterable[float], level: float = CI_LEVEL) -> tuple[float, float, float, int]:
    """(mean, lo, hi, s) of the finite values: t-interval over s values; lo = hi = NaN when s < 2."""
    x, m, s = _finite(values)
    if s < 2:
        return m, math.nan, math.nan, s
    half = t_quantile(0.5 + level / 2, s - 1) * float(x.std(ddof=1)) / math.sqrt(s)
    return m, m - half, m + half, s


def rate_ci(values: Iterable[float], level: float = CI_LEVEL) -> tuple[float, float, float, int]:
    """(rate, lo, hi, s) of 0/1 values: Wilson score interval over s values, always inside [0, 1].

    A t-interval on 0/1 outcomes over 3 seeds gives nonsense (1 of 3: [-1.10, 1.77]; 0 of 3: [0, 0]); Wilson
    stays in range and says that 0 of 3 does not mean a rate of 0 (0 of 3: [0, 0.56]). NaN bounds if s < 2.
    """
    _, p, s = _finite(values)
    if s < 2:
        return p, math.nan, math.nan, s
    return p, *wilson(p, s, normal_quantile(0.5 + level / 2)), s


def wilson(p: float, n: int, z: float) -> tuple[float, float]:
    """Wilson score interval (lo, hi) of a rate p observed over n > 0 trials, critical value z."""
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_diff_ci(x: Iterable[float], y: Iterable[float], level: float = CI_LEVEL, paired: bool = False):
    """(difference, lo, hi, n) of two rates of 0/1 outcomes, mean(x) - mean(y), with Newcombe's score
    interval built from the two Wilson intervals (Newcombe 1998: method 10 for independent samples; for
    paired ones, x[i] and y[i] from one unit, the same with the phi correlation of the pairs, his method 10
    for paired data). Stays inside [-1, 1] and has a width where a t-interval on 0/1 values has none
    (3 of 3 against 0 of 3: a t-interval is [1, 1]). n: pairs (paired) or len(x) + len(y); NaN bounds
    when a side has no value."""
    xa, p1, n1 = _finite(x)
    ya, p2, n2 = _finite(y)
    if paired and n1 != n2:
        raise ValueError(f"paired rates need as many x as y values, got {n1} and {n2}")
    if n1 == 0 or n2 == 0:
        return p1 - p2 if n1 and n2 else math.nan, math.nan, math.nan, n1 if paired else n1 + n2
    z = normal_quantile(0.5 + level / 2)
    (l1, u1), (l2, u2) = wilson(p1, n1, z), wilson(p2, n2, z)
    phi = 0.0
    if paired:
        a, b = float(((xa == 1) & (ya == 1)).sum()), float(((xa == 1) & (ya == 0)).sum())
        c, d = float(((xa == 0) & (ya == 1)).sum()), float(((xa == 0) & (ya == 0)).sum())
        den = (a + b) * (c + d) * (a + c) * (b + d)
        phi = (a * d - b * c) / math.sqrt(den) if den > 0 else 0.0
    diff = p1 - p2
    dl = math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    du = math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return diff, max(-1.0, diff - dl), min(1.0, diff + du), n1 if paired else n1 + n2


def _as2d(x, shape=None) -> np.ndarray:
    """x as a float (R, K) array: a (K,) row becomes (1, K); with `shape`, scalars and rows broadcast."""
    a = np.asarray(x, dtype=float)
    if shape is None:
        return a[None, :] if a.ndim == 1 else a
    return np.broadcast_to(a, shape).astype(float)


def binomial_var(acc: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per-eval variance numerator v (R, K): max(q_k (1 - q_k), q (1 - q)) with Laplace-smoothed q_k
    (this eval) and q (all of the run's evals); dividing by a half's size gives that half's variance."""
    x = acc * n
    qk = (x + 1) / (n + 2)
    q = (x.sum(1, keepdims=True) + 1) / (n.sum(1, keepdims=True) + 2)
    return np.maximum(qk * (1 - qk), q * (1 - q))


def confirmed_peak(acc_a, acc_b, n_a, n_b) -> np.ndarray:
    """Cross-fitted peak (R,): the step best on half a read on half b and the step best on half b read on
    half a, weighted by the half sizes. The half that picks a step never scores it."""
    a, b = _as2d(acc_a), _as2d(acc_b)
    na, nb = _as2d(n_a, a.shape), _as2d(n_b, a.shape)
    rows = np.arange(a.shape[0])
    ja, jb = np.argmax(a, axis=1), np.argmax(b, axis=1)  # first maximum
    fb = nb[rows, ja] / (na[rows, ja] + nb[rows, ja])
    fa = na[rows, jb] / (na[rows, jb] + nb[rows, jb])
    return fb * b[rows, ja] + fa * a[rows, jb]


def _window_weights(shape, window: int) -> np.ndarray:
    R, K = shape
    m = min(window, K)
    w = np.zeros((R, K))
    w[:, K - m :] = 1.0 / m
    return w


def curve_tests(acc, n, acc_a=None, acc_b=None, n_a=None, n_b=None, *, has_base=True,
                window: int = TERMINAL_WINDOW, alpha: float = ALPHA) -> dict[str, np.ndarray]:  # fmt: skip
    """Cliff / collapse / stagnation tests of R eval curves with K evals each (DEFINITIONS has the rules).

    acc: (R, K) accuracies in step order, eval 0 the base when has_base; n: eval sizes, (R, K), (K,) or a
    scalar. acc_a / acc_b, n_a / n_b (optional): the same on the two fixed halves of the eval set, used only
    for peak_confirmed (NaN where absent). Returns arrays of shape (R,): terminal_mean, peak_confirmed,
    drop, drop_se, drop_z, cliff, gain, gain_se, stagnation, collapse_diff, collapse_se, collapse; without a
    base, gain / collapse values are NaN and the collapse and stagnation flags False.
    """
    acc = _as2d(acc)
    R, K = acc.shape
    shape = (R, K)
    n = _as2d(n, shape)
    v = binomial_var(acc, n)
    tw = _window_weights(shape, window)
    bw = np.zeros(shape)
    bw[:, 0] = 1.0
    peak = np.full(R, np.nan)
    if acc_a is not None and acc_b is not None and n_a is not None and n_b is not None:
        a, b = _as2d(acc_a, shape), _as2d(acc_b, shape)
        na, nb = _as2d(n_a, shape), _as2d(n_b, shape)
        ok = np.isfinite(a).all(1) & np.isfinite(b).all(1) & (na > 0).all(1) & (nb > 0).all(1)
        if ok.any():
            peak[ok] = confirmed_peak(a[ok], b[ok], na[ok], nb[ok])
    drop, dse, dz = _cliff_union(acc, v / n, window, alpha, has_base)
    gain, gse, gz = _union_max(acc, n, v, bw, range(1, K), alpha)
    cliff = np.nan_to_num(drop, nan=-np.inf) >= np.maximum(MIN_GAP, dz * dse) - TOL
    stagnation = ~(gain >= np.maximum(MIN_GAP, gz * gse) - TOL)
    cw = bw - tw  # collapse: base vs terminal mean, nothing selected, so the plain one-sided z
    cdiff = (cw * acc).sum(1)
    cse = np.sqrt((cw * cw * v / n).sum(1))
    collapse = cdiff >= np.maximum(MIN_GAP, normal_quantile(1 - alpha) * cse) - TOL
    if not has_base:
        collapse[:] = stagnation[:] = False
        gain[:] = gse[:] = cdiff[:] = cse[:] = np.nan
    if K < 2:  # one eval: nothing to compare
        cliff[:] = collapse[:] = stagnation[:] = False
    return dict(terminal_mean=(tw * acc).sum(1), peak_confirmed=peak, drop=drop, drop_se=dse, drop_z=dz,
                cliff=cliff, gain=gain, gain_se=gse, stagnation=stagnation, collapse_diff=cdiff,
                collapse_se=cse, collapse=collapse)  # fmt: skip


def _cliff_union(acc, u, window, alpha, has_base=False):
    """Union-bound cliff test: each candidate peak k is compared with the mean of the last min(window, K-1-k)
    evals, all strictly after k (so a candidate is never part of its own reference). Candidates: with a base
    (eval 0 is step 0), the evals 1 .. K-2 that improved on it (acc_k > acc_0): a run that never rose above
    its base has no peak to fall from, so it is a collapse or stagnation, never a cliff; without one (the
    curve of cliff_guard, which starts at its best eval), every eval k < K-1.
    u: (R, K) variance of each eval's accuracy. Returns (d, se, z) at the candidate with the largest margin
    d - max(MIN_GAP, z se), z at alpha / (number of possible candidates: K-2 with a base, else K-1; the
    data-dependent filter only removes candidates, so the union bound still holds); NaN d where a run has
    no candidate."""
    R, K = acc.shape
    first = 1 if has_base else 0
    if K - 1 - first < 1:
        nan = np.full(R, np.nan)
        return nan, nan.copy(), nan.copy()
    z = normal_quantile(1 - alpha / (K - 1 - first))
    d, var = np.empty((R, K - 1)), np.empty((R, K - 1))
    for k in range(K - 1):
        m = min(window, K - 1 - k)
        ref = acc[:, K - m :].mean(1)
        d[:, k] = acc[:, k] - ref
        var[:, k] = u[:, k] + u[:, K - m :].sum(1) / m**2
    s = np.sqrt(var)
    ok = np.ones((R, K - 1), dtype=bool)
    if has_base:
        ok[:, 0] = False
        ok[:, 1:] = acc[:, 1 : K - 1] > acc[:, :1]
    margin = np.where(ok, d - np.maximum(MIN_GAP, z * s), -np.inf)
    best = np.argmax(margin, axis=1)
    rows = np.arange(R)
    none = ~ok.any(1)
    dd, ss = d[rows, best], s[rows, best]
    dd[none] = ss[none] = np.nan
    return dd, ss, np.full(R, z)


def _union_max(acc, n, v, ref_w, candidates, alpha):
    """Union-bound test over candidate evals k of d_k = acc_k - (ref_w applied to acc), each with its SE.

    Returns (d, se, z) at the candidate with the largest margin d - max(MIN_GAP, z se), z = the one-sided
    critical value at alpha / (number of candidates): if every d_k is pure noise, the chance that any one
    passes is at most alpha.
    """
    R, K = acc.shape
    cand = list(candidates)
    if not cand:
        nan = np.full(R, np.nan)
        return nan, nan.copy(), nan.copy()
    z = normal_quantile(1 - alpha / len(cand))
    u = v / n  # variance of each eval's accuracy
    ref = (ref_w * acc).sum(1, keepdims=True)
    # Var(acc_k - sum_j r_j acc_j) = u_k (1 - 2 r_k) + sum_j r_j^2 u_j   (evals independent)
    var = u * (1 - 2 * ref_w) + (ref_w * ref_w * u).sum(1, keepdims=True)
    d, s = (acc - ref)[:, cand], np.sqrt(var[:, cand])
    best = np.argmax(d - np.maximum(MIN_GAP, z * s), axis=1)
    rows = np.arange(R)
    return d[rows, best], s[rows, best], np.full(R, z)


# ---------------------------------------------------------------------------------------------------------------
# The claims' intervals from counts, vectorised, and their power (marlflow.analysis.claims). Every function takes
# numpy arrays of any (broadcastable) shape, so that tests/test_claims_power.py can simulate the claims rule 10^4+
# times with the very functions the claims table calls.


def _log_factorials(n: int) -> np.ndarray:
    """log(k!) for k = 0..n, shape (n + 1,)."""
    return np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1, dtype=float)))])


def _xlogy(k: np.ndarray, p: np.ndarray) -> np.ndarray:
    """k log p with 0 log 0 = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(k == 0, 0.0, k * np.log(np.where(k == 0, 1.0, p)))


def binom_pmf(n: int, p) -> np.ndarray:
    """Binomial(n, p) probabilities of 0..n: shape p.shape + (n + 1,)."""
    p = np.asarray(p, dtype=float)[..., None]
    k = np.arange(n + 1)
    lf = _log_factorials(n)
    return np.exp(lf[n] - lf[k] - lf[n - k] + _xlogy(k, p) + _xlogy(n - k, 1 - p))


def _bisect(below, lo, hi, iters: int = 64) -> np.ndarray:
    """Vectorised bisection: the boundary x in [lo, hi] of a predicate `below(x)` that is True left of it."""
    lo, hi = np.array(lo, dtype=float), np.array(hi, dtype=float)
    for _ in range(iters):
        mid = (lo + hi) / 2
        left = below(mid)
        lo, hi = np.where(left, mid, lo), np.where(left, hi, mid)
    return (lo + hi) / 2


def clopper_pearson(k, n: int, level: float = CI_LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """Exact (Clopper-Pearson) interval (lo, hi) of a binomial rate, k successes of n, each tail <= (1 - level) / 2
    for every true rate: lo > p0 rejects p <= p0 by the exact one-sided binomial test at (1 - level) / 2 (a sign
    test for p0 = 0.5), so k = n of many trials is evidence (n = 72: lo = 0.932 at level 0.9875). k: array."""
    k = np.asarray(k)
    a = (1 - level) / 2
    uniq, inv = np.unique(k, return_inverse=True)
    j = np.arange(n + 1)

    def tail_ge(p):  # P(X >= k | p), (U,)
        return (binom_pmf(n, p) * (j[None, :] >= uniq[:, None])).sum(1)

    def cdf_le(p):  # P(X <= k | p)
        return (binom_pmf(n, p) * (j[None, :] <= uniq[:, None])).sum(1)

    z, o = np.zeros(len(uniq)), np.ones(len(uniq))
    lo = np.where(uniq == 0, 0.0, _bisect(lambda p: tail_ge(p) < a, z, o))
    hi = np.where(uniq == n, 1.0, _bisect(lambda p: cdf_le(p) > a, z, o))
    return lo[inv].reshape(k.shape), hi[inv].reshape(k.shape)


def wilson_arr(x, n, z: float) -> tuple[np.ndarray, np.ndarray]:
    """`wilson` for arrays of counts x of n > 0 trials."""
    x, n = np.asarray(x, dtype=float), np.asarray(n, dtype=float)
    p = x / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return np.maximum(0.0, centre - half), np.minimum(1.0, centre + half)


def newcombe_ci(x1, n1, x2, n2, level: float = CI_LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """Newcombe's hybrid score interval (lo, hi) of p1 - p2 for two independent samples, x1 of n1 and x2 of n2
    (his method 10; `rate_diff_ci` with paired=False from counts). Arrays."""
    z = normal_quantile(0.5 + level / 2)
    x1, n1, x2, n2 = (np.asarray(v, dtype=float) for v in (x1, n1, x2, n2))
    p1, p2 = x1 / n1, x2 / n2
    (l1, u1), (l2, u2) = wilson_arr(x1, n1, z), wilson_arr(x2, n2, z)
    d = p1 - p2
    dl = np.sqrt(np.maximum((p1 - l1) ** 2 + (u2 - p2) ** 2, 0.0))
    du = np.sqrt(np.maximum((u1 - p1) ** 2 + (p2 - l2) ** 2, 0.0))
    return np.maximum(-1.0, d - dl), np.minimum(1.0, d + du)


def tango_score(b, c, n, delta) -> np.ndarray:
    """Tango's (1998) score statistic for H0: p10 - p01 = delta in n paired 0/1 outcomes, b pairs (1, 0) and c
    pairs (0, 1): (b - c - n delta) / sqrt(n (2 q + delta (1 - delta))), q the MLE of p01 under H0. At delta = 0
    it is McNemar's (b - c) / sqrt(b + c). Decreasing in delta. Arrays."""
    b, c, n, d = (np.asarray(v, dtype=float) for v in (b, c, n, delta))
    w = -b - c + (2 * n - b + c) * d
    q = (np.sqrt(np.maximum(w * w + 8 * n * c * d * (1 - d), 0.0)) - w) / (4 * n)
    var = n * (2 * q + d * (1 - d))
    num = b - c - n * d
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(var > 0, num / np.sqrt(np.maximum(var, 1e-300)), np.sign(num) * np.inf)


def tango_ci(b, c, n, level: float = CI_LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """Tango's score interval (lo, hi) of p10 - p01 = (rate of x) - (rate of y) for n pairs of 0/1 outcomes (x, y),
    b of them (1, 0) and c (0, 1): the deltas the score test at 1 - level does not reject. Unlike Newcombe's
    paired interval (up to 1.79% false verdicts at the null against 1.25% nominal, 36 pairs) it holds its level
    (benchmarks/RESULTS.md, "Claims: false verdicts, coverage and power"). Arrays; NaN where n = 0."""
    b, c, n = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (b, c, n)))
    z = normal_quantile(0.5 + level / 2)
    nn = np.where(n > 0, n, 1.0)
    d = (b - c) / nn
    eps = 1e-12
    lo = _bisect(lambda x: tango_score(b, c, nn, x) > z, np.full(d.shape, -1 + eps), d)
    hi = _bisect(lambda x: tango_score(b, c, nn, x) >= -z, d, np.full(d.shape, 1 - eps))
    lo = np.where(tango_score(b, c, nn, -1 + eps) <= z, -1.0, lo)
    hi = np.where(tango_score(b, c, nn, 1 - eps) >= -z, 1.0, hi)
    bad = n <= 0
    return np.where(bad, np.nan, lo), np.where(bad, np.nan, hi)


def mean_ci_rows(x, level: float = CI_LEVEL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`mean_ci` of each row of x, shape (..., s) of finite values: (mean, lo, hi), each shape (...); lo = hi = NaN
    when s < 2."""
    x = np.asarray(x, dtype=float)
    s = x.shape[-1]
    m = x.mean(-1) if s else np.full(x.shape[:-1], np.nan)
    if s < 2:
        nan = np.full(m.shape, np.nan)
        return m, nan, nan.copy()
    half = t_quantile(0.5 + level / 2, s - 1) * x.std(-1, ddof=1) / math.sqrt(s)
    return m, m - half, m + half


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * np.vectorize(math.erfc, otypes=[float])(-np.asarray(x, dtype=float) / math.sqrt(2))


def t_power(effect: float, sd: float, s: int, level: float) -> float:
    """P(the lower bound of mean_ci over s normal values of mean `effect` and standard deviation sd is > 0): the
    one-sided power of the t-interval, exactly (the noncentral t, integrated over the chi distribution of the
    sample sd by the trapezoid rule on 4001 points)."""
    if s < 2 or not sd > 0:
        return math.nan
    nu = s - 1
    tc = t_quantile(0.5 + level / 2, nu)
    w = np.linspace(0.0, math.sqrt(nu) + 12.0, 4001)  # chi_nu: the sample sd is sd * w / sqrt(nu)
    f = np.exp((nu - 1) * np.log(np.maximum(w, 1e-300)) - w * w / 2 - (nu / 2 - 1) * math.log(2))
    f /= math.gamma(nu / 2)
    g = _normal_cdf(effect * math.sqrt(s) / sd - tc * w / math.sqrt(nu)) * f
    return float(((g[1:] + g[:-1]) / 2 * np.diff(w)).sum())


def smallest_effect(power, hi: float, target: float = 0.8, tol: float = 1e-5) -> float:
    """The smallest effect in (0, hi] whose power(effect) reaches `target`, by bisection (power increasing in the
    effect); inf when even hi falls short (no effect in range is detected that often)."""
    if not power(hi) >= target:
        return math.inf
    lo = 0.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power(mid) < target else (lo, mid)
    return hi


def mde_mean(sd: float, s: int, level: float, target: float = 0.8) -> float:
    """Minimum detectable effect of the t-interval over s replicates with standard deviation sd: the smallest
    true mean whose lower bound at `level` exceeds 0 with probability `target` (t_power)."""
    if s < 2 or not sd > 0:
        return math.nan
    return smallest_effect(lambda e: t_power(e, sd, s, level), 50 * sd, target, tol=1e-6 * sd)


def mde_rate(n: int, null: float, level: float, target: float = 0.8) -> float:
    """Minimum detectable effect p - null of the exact (Clopper-Pearson) test over n trials: the smallest true
    rate above `null` whose interval lies above `null` with probability `target`, exactly (binomial sums)."""
    if n < 1:
        return math.nan
    reject = clopper_pearson(np.arange(n + 1), n, level)[0] > null
    return smallest_effect(lambda e: float((binom_pmf(n, null + e) * reject).sum()), 1 - null, target)


def _trinomial(n: int, p10: float, p01: float) -> np.ndarray:
    """P(b, c) of (n + 1, n + 1) counts of (1, 0) and (0, 1) pairs among n; 0 where b + c > n."""
    lf = _log_factorials(n)
    b, c = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    ok = b + c <= n
    r = np.where(ok, n - b - c, 0)
    lp = lf[n] - lf[b] - lf[c] - lf[r] + _xlogy(b, p10) + _xlogy(c, p01) + _xlogy(r, max(1 - p10 - p01, 0.0))
    return np.where(ok, np.exp(lp), 0.0)


def mde_paired_rates(n: int, q0: float, level: float, target: float = 0.8) -> float:
    """Minimum detectable effect of Tango's interval over n pairs: the smallest delta with p01 = q0 and
    p10 = q0 + delta (the data's discordance q0 under the null, plus the effect) whose interval lies above 0 with
    probability `target`, exactly (sums over every (b, c))."""
    if n < 1:
        return math.nan
    b, c = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    reject = (tango_ci(b, c, n, level)[0] > 0) & (b + c <= n)
    return smallest_effect(lambda e: float((_trinomial(n, q0 + e, q0) * reject).sum()), 1 - 2 * q0, target)


def mde_two_rates(n1: int, n2: int, p0: float, level: float, target: float = 0.8) -> float:
    """Minimum detectable effect of Newcombe's interval for p1 - p2 (n1 and n2 independent trials): the smallest
    delta with p2 = p0 (the pooled rate) and p1 = p0 + delta whose interval lies above 0 with probability
    `target`, exactly."""
    if n1 < 1 or n2 < 1:
        return math.nan
    x1, x2 = np.meshgrid(np.arange(n1 + 1), np.arange(n2 + 1), indexing="ij")
    reject = newcombe_ci(x1, n1, x2, n2, level)[0] > 0
    p2 = binom_pmf(n2, p0)

    def power(e):
        return float((np.outer(binom_pmf(n1, p0 + e), p2) * reject).sum())

    return smallest_effect(power, 1 - p0, target)
