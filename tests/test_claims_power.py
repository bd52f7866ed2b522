"""The claims rule holds its level and states its power: the family-wise false-verdict rate from >= 10^4
simulated null matrices per seed at three seeds, shaped like the committed evidence; the coverage of every
interval type the claims use; the `mde` column as the effect found with 80% power; the exact C1 test and
Tango's interval against independent computations; and the findings box's corrected SP - IP wording and its
capture counts per sharing mode. The numbers are in benchmarks/RESULTS.md ("Claims: false verdicts, coverage
and power": python benchmarks/stats/claims_power.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from marlflow.analysis.claims import (
    CLAIMS,
    FAMILY_ALPHA,
    LEVEL,
    VALIDATED,
    VERDICTS,
    NullShape,
    claims_table,
    count_ci,
    false_verdicts,
    groups_ci,
    interval_coverage,
    pairs_ci,
    rule_on_draws,
    simulate,
)
from marlflow.analysis.curves import SUMMARY_COLUMNS
from marlflow.analysis.gradients import GRAD_COLUMNS
from marlflow.core.stats import (
    clopper_pearson,
    mde_mean,
    mde_paired_rates,
    mde_rate,
    mde_two_rates,
    mean_ci_rows,
    tango_ci,
    tango_score,
)

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "results" / "evidence"
ALPHA = FAMILY_ALPHA / len(VALIDATED)  # each validated claim's share of the family's 5%


@pytest.fixture(scope="module")
def shapes() -> dict[str, NullShape]:
    """toy_seeds as committed (6 replicates = 3 seeds x 2 builds), and the one-seed toy matrix rerun with 3
    seeds (its one replicate gives no interval, so no verdict: the rule can only err from 2 replicates on)."""
    return {
        "toy_seeds": NullShape.from_summary(pd.read_parquet(EVIDENCE / "toy_seeds" / "summary.parquet")),
        "toy x 3 seeds": NullShape.from_summary(pd.read_parquet(EVIDENCE / "toy" / "summary.parquet"), 3),
    }


def test_shapes_are_the_evidence(shapes):
    s = shapes["toy_seeds"]
    assert s.replicates == 6 and len(s.cells) == 6 and sum(s.parallel) == 4
    assert all(len(x) == 6 for x in s.spread)  # each cell's own 6 replicates
    toy = shapes["toy x 3 seeds"]
    assert toy.replicates == 3 and all(len(x) == 3 for x in toy.spread)  # one seed: its task's 3 cells


def summary_of(shape: NullShape, draws: dict[str, np.ndarray], i: int) -> pd.DataFrame:
    """The summary of simulated matrix i: replicate r is seed r // 2 on build r % 2, every cell an SP and an IP
    run (IP's held-out peak = SP's + the drawn difference), plus a single-agent run per task and replicate."""
    recs = []
    tasks = sorted({c[2] for c in shape.cells})
    for r in range(shape.replicates):
        seed, build = divmod(r, 2)
        runs = [("single", "sp", "toy", t, True, 0.0, False) for t in tasks]
        for j, (wf, scale, task) in enumerate(shape.cells):
            for k, sharing in enumerate(("sp", "ip")):
                runs.append((wf, sharing, scale, task, bool(draws["not_stagnant"][i, r, j, k]),
                             float(draws["diff"][i, r, j]) if k else 0.0, bool(draws["cliff"][i, r, j, k])))  # fmt: skip
        for wf, sharing, scale, task, moved, d, cliff in runs:
            rec = dict.fromkeys(SUMMARY_COLUMNS, math.nan)
            rec.update(run_id=f"{wf}-{sharing}-{scale}-{task}-s{seed}-b{build}", workflow=wf, sharing=sharing,
                       scale=scale, task=task, seed=seed, build=build, intervention="none", base=0.3,
                       peak_heldout=0.6 + d, gain_heldout=0.3 + d, cliff=cliff, collapse=False,
                       stagnation=not moved, n_evals=5)  # fmt: skip
            recs.append(rec)
    return pd.DataFrame(recs, columns=SUMMARY_COLUMNS)


def test_the_simulated_rule_is_the_claims_table(shapes):
    """rule_on_draws gives, matrix by matrix, the values, intervals and verdicts claims_table gives on the
    summary of the same simulated matrix: null matrices and ones with effects either way, so that every
    validated claim is seen supported, contradicted or inconclusive here."""
    shape = shapes["toy_seeds"]
    rng = np.random.default_rng(11)
    blocks = [simulate(shape, rng, 8, cliff_sp=0.3, cliff_ip=0.3),
              simulate(shape, rng, 8, stay=0.8, shift=0.06, cliff_sp=0.05, cliff_ip=0.1, cliff_parallel=0.8),
              simulate(shape, rng, 8, stay=0.2, shift=-0.06, cliff_sp=0.7, cliff_ip=0.8, cliff_parallel=0.05)]  # fmt: skip
    draws = {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
    rule = rule_on_draws(shape, draws)
    grads = pd.DataFrame(columns=GRAD_COLUMNS)
    seen = {cid: set() for cid in VALIDATED}
    for i in range(len(draws["diff"])):
        table = claims_table(summary_of(shape, draws, i), grads).set_index("claim")
        for cid in VALIDATED:
            value, lo, hi, code = (float(v[i]) for v in rule[cid])
            row = table.loc[cid]
            assert (row["value"], row["ci_lo"], row["ci_hi"]) == (pytest.approx(value, abs=1e-12),
                                                                  pytest.approx(lo, abs=1e-9),
                                                                  pytest.approx(hi, abs=1e-9)), (cid, i)  # fmt: skip
            assert row["verdict"] == VERDICTS[int(code)], (cid, i)
            seen[cid].add(row["verdict"])
    assert all(v == {"supported", "contradicted", "inconclusive"} for v in seen.values()), seen


@pytest.mark.parametrize("noise", ["normal", "t3"])
@pytest.mark.parametrize("cliff", [None, 0.5], ids=["evidence_cliff_rate", "cliff_rate_0.5"])
@pytest.mark.parametrize("name", ["toy_seeds", "toy x 3 seeds"])
def test_family_wise_false_verdicts_at_most_5_percent_at_three_seeds(shapes, name, cliff, noise):
    """Every null holds (C1: each run escapes stagnation with probability 0.5; C3: IP - SP differences centred
    on 0 with each cell's spread; C4, C5: SP and IP cliffs at one rate): in 50,000 matrices per seed, for
    three seeds, the share with any verdict is <= 5% by more than twice its Monte Carlo SE, and each claim's
    share is within 3 SE of its 1.25% (0.1 point allowed for the discreteness of the rate intervals).
    cliff 0.5 is where C4 and C5 can err most; the evidence's own rate (1 cliff in 72 multi-agent runs of
    toy_seeds, none in toy) leaves them almost no false verdict."""
    shape = shapes[name]
    for seed in (0, 1, 2):
        rng = np.random.default_rng(seed)
        draws = simulate(shape, rng, 50_000, noise=noise, cliff_sp=cliff, cliff_ip=cliff)
        fv = false_verdicts(rule_on_draws(shape, draws))
        rate, se = fv["any"]
        assert rate + 2 * se <= FAMILY_ALPHA, (name, seed, fv)
        for cid in VALIDATED:
            assert fv[cid][0] <= ALPHA + 0.001 + 3 * fv[cid][1], (name, seed, cid, fv)
        assert rate >= fv["C1"][0] and fv["C3"][0] > 0.005  # the simulation does produce false verdicts


@pytest.fixture(scope="module")
def coverage(shapes) -> dict[str, pd.DataFrame]:
    rng = np.random.default_rng(3)
    return {name: interval_coverage(s, rng, n_sims=100_000) for name, s in shapes.items()}


def test_every_interval_type_holds_its_level(coverage):
    """Each interval type the claims use, at the evidence's sample sizes: its mean coverage over the parameter
    space within 1 point of nominal (Monte Carlo rows: within 1 point + 3 SE), and for those that carry a
    verdict (C1, C3 on unimodal values, C4, C5) the false-verdict rate at the claim's null, at its worst
    nuisance value, at most the nominal 1.25% plus 0.1 point."""
    for name, t in coverage.items():
        used = t[~t["used_by"].str.startswith("C4 before")]
        assert set(used["interval"].str.split(" ").str[0]) == {"Clopper-Pearson", "Wilson", "Newcombe,", "Tango",
                                                               "t"}  # fmt: skip
        for r in used.to_dict("records"):
            assert abs(r["mean_coverage"] - r["level"]) <= 0.01 + 3 * r["mc_se"], (name, r)
            verdict_bearing = r["used_by"].startswith(("C1", "C4", "C5")) or r["used_by"].endswith(
                ("normal values", "normal", "t3")
            )
            if verdict_bearing:
                assert r["null_false_max"] <= (1 - r["level"]) + 0.001 + 3 * r["mc_se"], (name, r)


def test_paired_newcombe_exceeds_its_level_so_c4_uses_tango(coverage):
    """Why C4 changed interval: Newcombe's paired interval gives more false verdicts at the null than its
    nominal 1.25% (36 pairs: up to 1.8%; 18 pairs: 2.4%), Tango's stays within 0.1 point of it."""
    for name, t in coverage.items():
        t = t.set_index("interval")
        assert t.loc["Newcombe, paired (stats.rate_diff_ci)", "null_false_max"] > 1.4 * ALPHA, name
        assert t.loc["Tango score, paired (stats.tango_ci)", "null_false_max"] <= ALPHA + 0.001, name


def test_c1_is_an_exact_test_so_unanimity_is_evidence():
    """72 of 72 runs (every multi-agent run of toy_seeds escapes stagnation): the Clopper-Pearson lower bound at
    1 - 0.05/4 is 0.00625^(1/72) = 0.932 > 0.5, supported; 36 of 72 is inconclusive; the bounds are the exact
    binomial tails (each tail = (1 - level) / 2 at the bound)."""
    value, lo, hi = count_ci(np.array([72, 36, 10]), 72, LEVEL)
    assert lo[0] == pytest.approx(((1 - LEVEL) / 2) ** (1 / 72), abs=1e-9) and hi[0] == 1.0
    assert lo[0] > 0.5 and lo[1] < 0.5 < hi[1] and hi[2] < 0.5
    a = (1 - LEVEL) / 2
    for k in (1, 10, 36, 71):  # P(X >= k | lo) = a and P(X <= k | hi) = a
        lo, hi = clopper_pearson(np.array([k]), 72, LEVEL)
        tail = sum(math.comb(72, j) * lo[0] ** j * (1 - lo[0]) ** (72 - j) for j in range(k, 73))
        head = sum(math.comb(72, j) * hi[0] ** j * (1 - hi[0]) ** (72 - j) for j in range(k + 1))
        assert tail == pytest.approx(a, rel=1e-6) and head == pytest.approx(a, rel=1e-6)


def test_tango_interval_inverts_the_score_test_with_a_numerical_mle():
    """Tango's interval against an independent computation: the constrained MLE of p01 found by a grid search of
    the likelihood (not the closed form), the score statistic, and the interval's ends where |score| = z. At
    delta 0 the score is McNemar's (b - c) / sqrt(b + c)."""
    from marlflow.core.stats import normal_quantile

    z = normal_quantile(0.5 + LEVEL / 2)
    for b, c, n in ((6, 0, 9), (2, 8, 21), (0, 1, 36), (5, 5, 12)):
        assert float(tango_score(b, c, n, 0.0)) == pytest.approx((b - c) / math.sqrt(b + c))

        def score(d, b=b, c=c, n=n):
            q = np.linspace(max(0.0, -d), (1 - d) / 2, 200_001)[1:-1]  # p01 = q, p10 = q + d, both in [0, 1]
            ll = b * np.log(q + d) + c * np.log(q) + (n - b - c) * np.log(1 - 2 * q - d)
            qh = q[np.argmax(ll)]
            return (b - c - n * d) / math.sqrt(n * (2 * qh + d * (1 - d)))

        lo, hi = (float(v) for v in tango_ci(b, c, n, LEVEL))
        for end, inside in ((lo, lo + 1e-3), (hi, hi - 1e-3)):
            assert abs(abs(score(end)) - z) < 2e-3 and abs(score(inside)) < z, (b, c, n, end)


def _power(test, draws) -> float:
    return float(np.mean(test(*draws)))


def test_mde_is_the_effect_found_with_80_percent_power():
    """Each kind's minimum detectable effect, simulated: at the effect mde_* states, 200,000 draws reach the
    claimed side with probability 0.8 (within 3 SE): the t-interval over 6 normal replicates, the exact test
    over 72 runs, Tango over 36 pairs with discordance 1/72, Newcombe over 24 vs 12 runs at a rate of 0."""
    rng, n, se = np.random.default_rng(5), 200_000, 3 * math.sqrt(0.16 / 200_000)
    e = mde_mean(0.02, 6, LEVEL)
    p = _power(lambda x: mean_ci_rows(x, LEVEL)[1] > 0, [rng.normal(e, 0.02, (n, 6))])
    assert p == pytest.approx(0.8, abs=se)
    e = mde_rate(72, 0.5, LEVEL)
    assert _power(lambda k: count_ci(k, 72, LEVEL)[1] > 0.5, [rng.binomial(72, 0.5 + e, n)]) == pytest.approx(
        0.8, abs=se + 0.01
    )  # a discrete test: the power at the stated effect is >= 0.8, and steps by < 0.01 here
    q0 = 1 / 72
    e = mde_paired_rates(36, q0, LEVEL)
    bc = rng.multinomial(36, [q0 + e, q0, 1 - 2 * q0 - e], n)
    p = _power(lambda b, c: pairs_ci(b, c, 36, LEVEL)[1] > 0, [bc[:, 0], bc[:, 1]])
    assert 0.8 - se <= p <= 0.8 + se + 0.02
    e = mde_two_rates(24, 12, 0.0, LEVEL)
    p = _power(lambda x1, x2: groups_ci(x1, 24, x2, 12, LEVEL)[1] > 0, [rng.binomial(24, e, n), np.zeros(n)])
    assert 0.8 - se <= p <= 0.8 + se + 0.02


def test_mde_column_comes_from_the_datas_own_variance():
    """On the committed toy_seeds: every validated claim and each C3 <task> row has an mde; it is what the
    stats.mde_* functions give on the row's own counts and replicate spread, at the row's level."""
    s = pd.read_parquet(EVIDENCE / "toy_seeds" / "summary.parquet")
    t = claims_table(s, pd.DataFrame(columns=GRAD_COLUMNS)).set_index("claim")
    assert t.loc[["C1", "C3", "C3 math", "C3 code", "C4", "C5"], "mde"].notna().all()
    assert t.loc[["C2", "C6", "C7"], "mde"].isna().all()
    claims = {c.cid: c for c in CLAIMS}
    runs = s[(s["n_evals"] > 0) & (s["intervention"] == "none")]
    k, n = claims["C1"].fn(runs, None)
    assert (k, n) == (72, 72) and t.loc["C1", "mde"] == pytest.approx(mde_rate(72, 0.5, LEVEL))
    for row, part in (("C3", runs), ("C3 math", runs[runs["task"] == "math"])):
        per = [claims["C3"].fn(g, None)[0] for _, g in part.groupby(["seed", "build"])]
        assert t.loc[row, "mde"] == pytest.approx(mde_mean(float(np.std(per, ddof=1)), 6, LEVEL))
    b, c, n = claims["C4"].fn(runs, None)
    assert t.loc["C4", "mde"] == pytest.approx(mde_paired_rates(n, (b + c) / (2 * n), LEVEL))
    x1, n1, x2, n2 = claims["C5"].fn(runs, None)
    assert t.loc["C5", "mde"] == pytest.approx(mde_two_rates(n1, n2, (x1 + x2) / (n1 + n2), LEVEL))


def test_docs_claims_numbers_come_from_the_committed_evidence():
    """docs/claims.md's numbers on toy_seeds (C1's count and bound, C3 and C3 math with their half-widths and
    MDEs) are recomputed from results/evidence/toy_seeds/summary.parquet."""
    text = " ".join((ROOT / "docs" / "claims.md").read_text().split())
    s = pd.read_parquet(EVIDENCE / "toy_seeds" / "summary.parquet")
    t = claims_table(s, pd.DataFrame(columns=GRAD_COLUMNS)).set_index("claim")
    c1 = t.loc["C1"]
    assert f"{int(c1['value'] * c1['n_cells'])} of {int(c1['n_cells'])} multi-agent runs" in text
    assert f"lower bound {c1['ci_lo']:.3f}" in text and c1["verdict"] == "supported"
    for row in ("C3", "C3 math", "C3 code"):
        r = t.loc[row]
        half = (r["ci_hi"] - r["ci_lo"]) / 2
        quoted = f"{row}: {r['value']:+.3f} ± {half:.3f}, MDE {r['mde']:.3f}".replace("-", "−")
        assert quoted in text, (quoted, re.findall(r"C3[^;]*MDE [0-9.]+", text))


# ----------------------------------------------------------------------------------------- the findings box


def contrasts_rows(cells: int, pairs: int = 6):
    """A contrasts.csv with `cells` SP - IP cells, each a held-out peak difference of +0.05 whose 95% CI over
    `pairs` pairs is [0.001, 0.099]."""
    recs = []
    for k in range(cells):
        for stat in ("peak_heldout", "terminal_mean3"):
            recs.append(dict(contrast="sp-ip", workflow="voting", sharing="sp-ip", scale="toy", task=f"t{k}",
                             intervention="none", stat=stat, n_pairs=pairs, mean=0.05, lo=0.001, hi=0.099))  # fmt: skip
    return pd.DataFrame(recs)


def test_findings_sp_ip_sides_are_bonferroni_corrected():
    """One cell: its 95% CI [0.001, 0.099] names a side (SP higher). Six cells with the same CI: each is widened
    to the level 1 - 0.05/6 (t quantile over 5 df), which includes 0: no side is named, and the header says
    which level and how many cells; the terminal's CI never names a side."""
    from marlflow.core.stats import t_quantile
    from marlflow.report import findings

    def summary(con):
        return pd.DataFrame({"n_evals": [5], "peak_heldout": [0.5], "peak_confirmed": [0.5]})

    one = contrasts_rows(1)
    line = findings.sp_ip_lines(one, summary(one))[0]
    assert "held-out peak +0.050 [+0.001, +0.099]: SP higher; terminal +0.050 [+0.001, +0.099] (6" in line
    six = contrasts_rows(6)
    level, m = findings.corrected_level(six, "peak_heldout")
    assert (level, m) == (pytest.approx(1 - 0.05 / 6), 6)
    half = 0.049 * t_quantile(0.5 + level / 2, 5) / t_quantile(0.975, 5)
    lines = findings.sp_ip_lines(six, summary(six))
    assert all(f"[{0.05 - half:+.3f}, {0.05 + half:+.3f}]: no clear difference" in x for x in lines), lines
    assert not any("SP higher" in x or "IP higher" in x for x in lines)


def test_findings_count_capture_per_sharing_mode():
    """Capture flags per sharing mode, over the runs whose workflow has a supervisory role (single runs cannot
    be captured and are not counted)."""
    from marlflow.report import findings

    ids = {"voting-sp-s0": True, "voting-sp-s1": True, "voting-ip-s0": False, "eval_opt-ip-s0": True,
           "single-sp-s0": False}  # fmt: skip
    failures = pd.DataFrame([dict(run_id=r, cliff=False, collapse=False, stagnation=False, capture=c, evidence="")
                             for r, c in ids.items()])  # fmt: skip
    metrics = pd.DataFrame([dict(run_id=r, workflow=r.split("-")[0], sharing=r.split("-")[1], scale="toy",
                                 task="math", seed=0, build=0, intervention="none", step=0, split="eval",
                                 role="all", metric="accuracy", value=0.5) for r in ids])  # fmt: skip
    assert findings.capture_by_sharing(findings.failure_flags(failures), metrics) == "SP 2 of 2, IP 1 of 2"
    lines = findings.failure_lines(failures, metrics)
    assert any("capture: 3 of 5 runs" in x and "SP 2 of 2, IP 1 of 2" in x for x in lines), lines
