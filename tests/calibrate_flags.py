"""Error rates of the run flags by simulation: capture (marlflow.analysis.failures), and stagnation and
collapse (marlflow.core.stats.curve_tests) on curves with a real gain, and the cliff test on flat runs
and on the realistic cliff shapes (`cliff_rates`: a rise from the base, then a 12-point drop over the last 3
evals, or at the last eval only). tests/test_calibration.py asserts the rates docs/reference.md states.

A supervisory role whose behaviour does not change between its first and last eval must be flagged as
captured rarely: each rule is a one-sided test at alpha/3 (Z_CAPTURE), so all three together flag such a role
in <= alpha = 4% of runs (union bound). Simulated here over the eval sizes marlflow uses (calls per eval n = 16
for the smoke preset, 32, 200 for toy, 1412 for the paper's DAPO-Math test split), shares p from 0.02 to 0.5,
and three length distributions, including a heavy-tailed one (most calls short, a few run to a 256-token
budget). The old length and format rules (effect size alone) are simulated beside them. Seeded: every run prints the same table.

Stagnation ("no eval significantly above base") is the right call on a flat run; on a run with a real gain
it is a lack of power, tabulated for a gain held from step 1 on, at K = 5 and 51 evals.

    python tests/calibrate_flags.py            # 10,000 runs per setting, about 30 s
    python tests/calibrate_flags.py --runs 2000
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from marlflow.analysis.failures import length_rise_test, share_rise_test
from marlflow.core.definitions import FORMAT_RISE, LENGTH_GROWTH, MARKER_RISE
from marlflow.core.stats import curve_tests

assert FORMAT_RISE == MARKER_RISE, "false_capture_rates simulates rules (b) and (c) as one"

NS = (16, 32, 200, 1412)
SHARES = (0.02, 0.1, 0.3, 0.5)
CAP = 256
LENGTHS = {  # per-call completion lengths of an unchanged role
    "poisson(20)": lambda rng, size: rng.poisson(20, size),
    "10% at the 256 cap, else 5": lambda rng, size: np.where(rng.random(size) < 0.10, CAP, 5),
    "2% at the 256 cap, else 5": lambda rng, size: np.where(rng.random(size) < 0.02, CAP, 5),
}


def lengths(draw, n: int, runs: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sample sd (ddof 1, as the trainer logs completion_length_sd) of n calls, for `runs` runs."""
    x = draw(rng, (runs, n)).astype(float)
    return x.mean(1), x.std(1, ddof=1)


def false_capture_rates(runs: int = 10_000, seed: int = 0) -> pd.DataFrame:
    """Share of unchanged runs flagged, per rule and setting (producer condition always met: worst case)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in NS:
        for p in SHARES:
            x0, x1 = rng.binomial(n, p, (2, runs)) / n
            # FORMAT_RISE and MARKER_RISE are both 0.2: one simulation covers rules (b) and (c)
            flag, _ = share_rise_test(x0, n, x1, n, FORMAT_RISE)
            out.append(
                dict(
                    rule="format / marker",
                    setting=f"p={p:g}",
                    n=n,
                    rate=flag.mean(),
                    old=(x1 - x0 >= FORMAT_RISE).mean(),
                )
            )
        for name, draw in LENGTHS.items():
            (m0, sd0), (m1, sd1) = lengths(draw, n, runs, rng), lengths(draw, n, runs, rng)
            flag, _ = length_rise_test(m0, sd0, n, m1, sd1, n, 0.0)
            out.append(
                dict(
                    rule="length", setting=name, n=n, rate=flag.mean(), old=(m1 >= LENGTH_GROWTH * m0).mean()
                )
            )
        # all three rules on one run (independent data per rule, the heaviest-tailed lengths, p = 0.3)
        x0, x1 = rng.binomial(n, 0.3, (2, runs)) / n
        fmt, _ = share_rise_test(x0, n, x1, n, FORMAT_RISE)
        x0, x1 = rng.binomial(n, 0.3, (2, runs)) / n
        mk, _ = share_rise_test(x0, n, x1, n, MARKER_RISE)
        draw = LENGTHS["10% at the 256 cap, else 5"]
        (m0, sd0), (m1, sd1) = lengths(draw, n, runs, rng), lengths(draw, n, runs, rng)
        ln, _ = length_rise_test(m0, sd0, n, m1, sd1, n, 0.0)
        out.append(
            dict(
                rule="any (capture)",
                setting="p=0.3, 10% at cap",
                n=n,
                rate=(fmt | mk | ln).mean(),
                old=np.nan,
            )
        )
    return pd.DataFrame(out)


def power(runs: int = 10_000, seed: int = 1) -> pd.DataFrame:
    """Share of runs flagged when the role does drift (n = 200 and 1412 calls per eval)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (200, 1412):
        for rule, (p0, p1) in (("marker", (0.05, 0.30)), ("format", (0.05, 0.30)), ("marker", (0.10, 0.30))):
            x0, x1 = rng.binomial(n, p0, runs) / n, rng.binomial(n, p1, runs) / n
            flag, _ = share_rise_test(x0, n, x1, n, MARKER_RISE if rule == "marker" else FORMAT_RISE)
            out.append(dict(rule=rule, change=f"{p0:g} -> {p1:g}", n=n, rate=flag.mean()))
        m0, sd0 = lengths(lambda r, s: r.poisson(12, s), n, runs, rng)
        m1, sd1 = lengths(lambda r, s: r.poisson(30, s), n, runs, rng)
        flag, _ = length_rise_test(m0, sd0, n, m1, sd1, n, 0.0)
        out.append(dict(rule="length", change="poisson 12 -> 30", n=n, rate=flag.mean()))
    return pd.DataFrame(out)


def gain_flag_rates(runs: int = 10_000, seed: int = 5) -> pd.DataFrame:
    """Stagnation and collapse rates of runs whose true accuracy is p at step 0 and p + gain at every later
    eval (independent binomial evals of n problems, split into two halves as the trainer does)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (32, 200, 1412):
        for k in (5, 51):
            for p in (0.3, 0.5):
                for gain in (0.0, 0.05, 0.10, 0.15):
                    truth = np.full((runs, k), p)
                    truth[:, 1:] += gain
                    na, nb = n // 2, n - n // 2
                    a, b = rng.binomial(na, truth) / na, rng.binomial(nb, truth) / nb
                    r = curve_tests((na * a + nb * b) / n, n, a, b, na, nb)
                    out.append(dict(n=n, k=k, p=p, gain=gain, stagnation=r["stagnation"].mean(),
                                    collapse=r["collapse"].mean()))  # fmt: skip
    return pd.DataFrame(out)


CLIFF_SHAPES = ("flat", "rise, drop over last 3", "rise, drop at last")
RISE, DROP = 0.15, 0.12  # the rise from the base to the peak, the drop from the peak


def cliff_truth(shape: str, p: float, k: int) -> np.ndarray:
    """(K,) true accuracy of a shape whose peak (or flat level) is p: flat; base p - RISE, then p from eval 1
    on, p - DROP over the last 3 evals; or the same with the drop at the last eval only."""
    t = np.full(k, p)
    if shape != "flat":
        t[0] = p - RISE
        t[-3 if shape == "rise, drop over last 3" else -1 :] -= DROP
    return t


def cliff_rates(runs: int = 10_000, seed: int = 11, ns=(32, 200, 1412), ks=(5, 13, 51)) -> pd.DataFrame:
    """Share of runs flagged as cliffs per shape (CLIFF_SHAPES), n, K and p: the false rate (flat) and the
    power (the two drop shapes). Independent binomial evals of n problems, split into halves as the trainer
    does."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in CLIFF_SHAPES:
        for n in ns:
            for k in ks:
                for p in (0.3, 0.5, 0.8):
                    truth = np.broadcast_to(cliff_truth(shape, p, k), (runs, k))
                    na, nb = n // 2, n - n // 2
                    a, b = rng.binomial(na, truth) / na, rng.binomial(nb, truth) / nb
                    r = curve_tests((na * a + nb * b) / n, n, a, b, na, nb)
                    out.append(dict(shape=shape, n=n, k=k, p=p, cliff=r["cliff"].mean()))
    return pd.DataFrame(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10_000)
    args = ap.parse_args(argv)
    fp = false_capture_rates(args.runs)
    print(
        f"False-capture rate of an unchanged role ({args.runs} runs per setting; 'old': effect size alone)\n"
    )
    print(
        fp.pivot_table(index=["rule", "setting"], columns="n", values="rate").to_string(
            float_format="{:.4f}".format
        )
    )
    print("\nold rules (before e2c7ccc: effect size alone; the marker rule already had a 1.75-SE test):\n")
    old = fp.dropna(subset=["old"]).replace({"rule": {"format / marker": "format"}})
    old = old.pivot_table(index=["rule", "setting"], columns="n", values="old")
    print(old.to_string(float_format="{:.4f}".format))
    print("\nPower (share of drifting runs flagged):\n")
    print(
        power(args.runs)
        .pivot_table(index=["rule", "change"], columns="n", values="rate")
        .to_string(float_format="{:.4f}".format)
    )
    c = cliff_rates(args.runs)
    print("\nCliff rate by shape (flat: false rate; the drops: power); rows shape, n, K; columns p:\n")
    print(
        c.pivot_table(index=["shape", "n", "k"], columns="p", values="cliff").to_string(
            float_format="{:.4f}".format
        )
    )
    g = gain_flag_rates(args.runs)
    print("\nStagnation rate by true gain (held from step 1 on); rows n, K, p:\n")
    print(
        g.pivot_table(index=["n", "k", "p"], columns="gain", values="stagnation").to_string(
            float_format="{:.3f}".format
        )
    )
    print("\nCollapse rate (a false flag at every gain >= 0):\n")
    print(
        g.pivot_table(index=["n", "k", "p"], columns="gain", values="collapse").to_string(
            float_format="{:.3f}".format
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
