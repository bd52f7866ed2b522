"""The claims rule's false verdicts under the null, the coverage of its intervals and its power, on matrices
shaped like the committed evidence: prints the tables of benchmarks/RESULTS.md, "Claims: false verdicts,
coverage and power".

    python benchmarks/stats/claims_power.py                 # 100,000 matrices per seed, seeds 0 1 2 (~3 min)
    python benchmarks/stats/claims_power.py --sims 10000 --seeds 0
    python benchmarks/stats/claims_power.py --quick         # checks that it runs; its numbers are not results

Everything is computed by marlflow.analysis.claims (simulate, rule_on_draws, false_verdicts, interval_coverage,
claims_table) with the interval functions of marlflow.core.stats that the claims table calls; the shapes come
from results/evidence/toy_seeds/summary.parquet (6 replicates) and results/evidence/toy/summary.parquet (one
seed, simulated as a rerun with 3 seeds). tests/test_claims_power.py checks the bounds these numbers meet.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd

from marlflow.analysis.claims import (
    LEVEL,
    VALIDATED,
    NullShape,
    claims_table,
    count_ci,
    false_verdicts,
    interval_coverage,
    rule_on_draws,
    simulate,
    sizes,
)
from marlflow.analysis.gradients import GRAD_COLUMNS

ROOT = Path(__file__).resolve().parents[2]
EVIDENCE = ROOT / "results" / "evidence"


def pct(rate: float, se: float | None = None) -> str:
    return f"{100 * rate:.2f}" + (f" ± {100 * se:.2f}" if se is not None else "")


def shapes() -> dict[str, NullShape]:
    return {
        "toy_seeds (6 replicates)": NullShape.from_summary(
            pd.read_parquet(EVIDENCE / "toy_seeds/summary.parquet")
        ),
        "toy x 3 seeds": NullShape.from_summary(pd.read_parquet(EVIDENCE / "toy/summary.parquet"), 3),
    }


def family_wise(all_shapes, sims: int, seeds: list[int], noises, cliffs) -> None:
    """Per shape, C3 noise and cliff rate: each claim's and the family's false-verdict rate, pooled over the
    seeds (± its Monte Carlo SE), and the family's rate at each seed."""
    print("\n### Family-wise false verdicts under the null (%, ± Monte Carlo SE)\n")
    print(
        f"{sims:,} matrices per seed, seeds {', '.join(map(str, seeds))}; nominal: 1.25 per claim, 5 in all.\n"
    )
    cols = [*VALIDATED, "any"]
    print("| shape | C3 noise | cliff rate | " + " | ".join(cols) + " | any, per seed |")
    print("|---|---|---|" + "---:|" * len(cols) + "---|")
    for name, shape in all_shapes.items():
        for noise in noises:
            for cliff in cliffs:
                per_seed, pooled = [], {c: [] for c in cols}
                for seed in seeds:
                    draws = simulate(shape, np.random.default_rng(seed), sims, noise=noise, cliff_sp=cliff,
                                     cliff_ip=cliff)  # fmt: skip
                    fv = false_verdicts(rule_on_draws(shape, draws))
                    per_seed.append(fv["any"][0])
                    for c in cols:
                        pooled[c].append(fv[c][0])
                n = sims * len(seeds)
                cells = []
                for c in cols:
                    r = float(np.mean(pooled[c]))
                    cells.append(pct(r, math.sqrt(r * (1 - r) / n)))
                rate = f"{shape.cliff_rate:.3f} (evidence)" if cliff is None else f"{cliff}"
                print(f"| {name} | {noise} | {rate} | " + " | ".join(cells) + " | "
                      + " / ".join(pct(r) for r in per_seed) + " |")  # fmt: skip


def c1_correlation(shape: NullShape, sims: int, seed: int, iccs) -> None:
    """C1's exact test assumes runs independent: its false-verdict rate when the runs of one replicate share
    their chance of escaping stagnation (intraclass correlation icc)."""
    print("\n### C1 when the runs of a replicate are correlated (%, ± MC SE)\n")
    print("| shape | intraclass correlation | C1 false verdicts |")
    print("|---|---:|---:|")
    for icc in iccs:
        draws = simulate(shape, np.random.default_rng(seed), sims, icc=icc)
        r = false_verdicts(rule_on_draws(shape, draws))["C1"]
        print(f"| {shape.replicates} replicates x {2 * len(shape.cells)} runs | {icc} | {pct(*r)} |")


def coverage(all_shapes, sims: int) -> None:
    print("\n### Coverage of each interval type at the evidence's sample sizes\n")
    print("Mean and minimum coverage over the parameter space (exact sums; Monte Carlo for the t rows, "
          f"{sims:,} draws), and the largest false-verdict rate at the claim's null (%).\n")  # fmt: skip
    print("| shape | interval | used by | n | level | mean coverage | min coverage | null false max |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for name, shape in all_shapes.items():
        t = interval_coverage(shape, np.random.default_rng(0), n_sims=sims)
        for r in t.to_dict("records"):
            se = r["mc_se"] or None
            low = "" if math.isnan(r["min_coverage"]) else pct(r["min_coverage"])
            false = "" if math.isnan(r["null_false_max"]) else pct(r["null_false_max"], se)
            print(f"| {name} | {r['interval']} | {r['used_by']} | {r['n']} | {100 * r['level']:.2f} | "
                  f"{pct(r['mean_coverage'], se)} | {low} | {false} |")  # fmt: skip


def committed_power() -> None:
    """The claims tables of the committed evidence with replicates: value, corrected interval, verdict, mde."""
    print("\n### Minimum detectable effects of the committed evidence (claims table, `mde`)\n")
    print("| evidence | claim | value | interval | verdict | mde (80% power) | n_seeds | n_cells |")
    print("|---|---|---:|---|---|---:|---:|---:|")
    for exp in ("toy_seeds", "toy_interventions"):
        t = claims_table(
            pd.read_parquet(EVIDENCE / exp / "summary.parquet"), pd.DataFrame(columns=GRAD_COLUMNS)
        )
        for r in t[t["mde"].notna()].to_dict("records"):
            print(f"| {exp} | {r['claim']} | {r['value']:+.3f} | [{r['ci_lo']:+.3f}, {r['ci_hi']:+.3f}] | "
                  f"{r['verdict']} | {r['mde']:.3f} | {r['n_seeds']} | {r['n_cells']} |")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument(
        "--sims", type=int, default=100_000, help="simulated matrices per seed (default %(default)s)"
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="2,000 matrices, one seed: checks that it runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.sims, args.seeds = 2_000, args.seeds[:1]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    t0 = time.time()
    all_shapes = shapes()
    print(f"commit {commit} (plus the working tree); level per claim {LEVEL:.4g}")
    for name, s in all_shapes.items():
        print(f"- {name}: sizes {sizes(s)}, cliff rate {s.cliff_rate:.4f}")
    family_wise(all_shapes, args.sims, args.seeds, ("normal", "t3", "signflip"), (None, 0.1, 0.3, 0.5))
    c1_correlation(all_shapes["toy_seeds (6 replicates)"], args.sims, args.seeds[0], (0.0, 0.02, 0.1))
    coverage(all_shapes, args.sims)
    committed_power()
    k = np.arange(73)
    lo = count_ci(k, 72, LEVEL)[1]
    print(f"\nC1 over 72 runs: supported from {int(k[lo > 0.5][0])} of 72 runs escaping stagnation.")
    print(f"\n{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
