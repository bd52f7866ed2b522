"""Coverage, false verdicts and power of the per-problem paired statistics (marlflow.core.paired,
marlflow.analysis.paired), by simulation:

    python benchmarks/stats/paired_coverage.py [--sims 10000] [--seed 0]

- paired_diff's 95% interval for a difference of two arms scored on the same P = 200 problems over R
  replicates, under the null (equal arms: coverage = 1 - the false-verdict rate) and with a real difference
  (power: the interval's lower end above 0). Problems have shared difficulty (logit N(0, 1.5)); each replicate
  gives each arm its own seed effect (logit N(0, seed_sd)).
- the paired cliff test (one-sided exact McNemar at ALPHA with the MIN_GAP drop) on a flat run: its peak and
  terminal evaluations of the same skill on the same problems, correlated through the problems: the false
  cliff rate; and on a run that loses a share of what it solved at its peak: the detection rate.
Each rate carries its Monte Carlo standard error. Numbers: benchmarks/RESULTS.md, "Paired statistics".
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from marlflow.core.definitions import ALPHA, MIN_GAP
from marlflow.core.paired import mcnemar_exact, paired_diff


def crossed(rng, sims: int, r: int, p: int, delta: float, seed_sd: float):
    """(sims, r, p) 0/1 outcomes of arms a and b (see the module docstring); a's logit shifted by delta."""
    u = rng.normal(0, 1.5, (sims, 1, p))
    sa, sb = rng.normal(0, seed_sd, (sims, r, 1)), rng.normal(0, seed_sd, (sims, r, 1))
    pa, pb = 1 / (1 + np.exp(-(u + sa + delta))), 1 / (1 + np.exp(-(u + sb)))
    return (rng.random((sims, r, p)) < pa).astype(float), (rng.random((sims, r, p)) < pb).astype(float)


def rate(hits) -> str:
    x = float(np.mean(hits))
    return f"{x:.4f} ± {math.sqrt(x * (1 - x) / len(hits)):.4f}"


def cliff_rates(rng, sims: int, p: int, lose: float) -> list[bool]:
    """Paired cliff flags of `sims` runs: peak outcomes ~ the problems' chances; terminal the same skill
    drawn again, less a share `lose` of the problems solved at the peak."""
    u = rng.normal(0, 1.5, (sims, p))
    chance = 1 / (1 + np.exp(-u))
    peak = rng.random((sims, p)) < chance
    term = (rng.random((sims, p)) < chance) & ~(peak & (rng.random((sims, p)) < lose))
    out = []
    for x, y in zip(peak, term):
        n10, n01 = int((x & ~y).sum()), int((~x & y).sum())
        out.append(x.mean() - y.mean() >= MIN_GAP and mcnemar_exact(n10, n01, "greater") < ALPHA)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sims", type=int, default=10_000, help="simulations per row")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    n = args.sims
    print("| R | seed sd | null: 95% interval coverage | power at logit +0.5 (about 8 points) |")
    print("|---|---|---|---|")
    for r, sd in [(1, 0.0), (2, 0.3), (3, 0.3), (3, 0.6), (6, 0.0), (6, 0.3), (6, 0.6)]:
        a, b = crossed(rng, n, r, 200, 0.0, sd)
        cov = [(s := paired_diff(a[i], b[i]))["lo"] <= 0 <= s["hi"] for i in range(n)]
        a, b = crossed(rng, n, r, 200, 0.5, sd)
        power = [paired_diff(a[i], b[i])["lo"] > 0 for i in range(n)]
        print(f"| {r} | {sd} | {rate(cov)} | {rate(power)} |")
    print()
    print("| paired cliff test, 200 problems | flag rate |")
    print("|---|---|")
    for lose, what in [(0.0, "flat run (null)"), (0.15, "terminal loses 15% of the peak's solved problems"),
                       (0.3, "terminal loses 30%")]:  # fmt: skip
        print(f"| {what} | {rate(cliff_rates(rng, n, 200, lose))} |")


if __name__ == "__main__":
    main()
