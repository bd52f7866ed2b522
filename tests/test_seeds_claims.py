"""Seeds as an axis (summary_by_cell, contrasts) and the claims table, on synthetic summaries with known
answers; plus the t quantiles the CIs use."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from marlflow.analysis import claims_table, contrasts, mean_ci, summary_by_cell
from marlflow.analysis.claims import VALIDATED, verdict
from marlflow.analysis.curves import SUMMARY_COLUMNS
from marlflow.analysis.gradients import GRAD_COLUMNS
from marlflow.core.stats import rate_ci, rate_diff_ci, t_quantile


@pytest.mark.parametrize(
    ("df", "t"), [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042)]
)
def test_t_quantile(df, t):
    assert t_quantile(0.975, df) == pytest.approx(t, abs=1e-3)


def test_mean_ci():
    m, lo, hi, s = mean_ci([0.5, 0.6, 0.7])
    assert (m, s) == (pytest.approx(0.6), 3)
    assert hi - m == pytest.approx(4.303 * 0.1 / math.sqrt(3), rel=1e-3) and lo == pytest.approx(2 * m - hi)
    m, lo, hi, s = mean_ci([0.5, float("nan")])
    assert m == 0.5 and s == 1 and math.isnan(lo) and math.isnan(hi)


def run(workflow, sharing, seed, base=0.3, peak=0.7, cliff=False, task="math", stagnation=False, build=0):
    """One run's summary row. `peak` is its held-out peak; the in-sample test maximum is 0.95 in every run,
    so a table or claim that read it instead would show no SP - IP difference at all."""
    rid = f"{workflow}-{sharing}-toy-{task}-s{seed}" + (f"-b{build}" if build else "")
    rec = dict.fromkeys(SUMMARY_COLUMNS, math.nan)
    rec.update(run_id=rid, workflow=workflow, sharing=sharing, scale="toy", task=task, seed=seed, build=build,
               intervention="none", base=base, peak=0.95, peak_step=20, terminal=peak, terminal_mean3=peak,
               peak_heldout=peak, peak_heldout_step=30, gain_heldout=peak - base,
               peak_confirmed=peak - 0.01, gain_peak=0.95 - base, gain_confirmed=peak - 0.01 - base,
               gain_terminal=peak - base, gain_terminal3=peak - base, cliff=cliff, collapse=False,
               stagnation=stagnation, n_evals=5)  # fmt: skip
    return rec


def summary(n_seeds: int) -> pd.DataFrame:
    recs = []
    for s in range(n_seeds):
        jitter = 0.01 * s
        recs.append(run("single", "sp", s, peak=0.5 + jitter))
        for wf in ("eval_opt", "voting", "orch_workers"):
            recs.append(run(wf, "sp", s, peak=0.6 + jitter))
            # IP: higher peak, cliffs in voting / orch_workers only
            recs.append(run(wf, "ip", s, peak=0.7 + jitter, cliff=wf != "eval_opt"))
    return pd.DataFrame(recs, columns=SUMMARY_COLUMNS)


def test_summary_by_cell_ci_and_one_seed():
    cells = summary_by_cell(summary(3))
    assert len(cells) == 7 and (cells["n_seeds"] == 3).all()
    v = cells[(cells["workflow"] == "voting") & (cells["sharing"] == "ip")].iloc[0]
    assert v["peak_heldout_mean"] == pytest.approx(0.71) and v["cliff_rate_mean"] == 1.0
    assert v["peak_heldout_lo"] < 0.71 < v["peak_heldout_hi"]
    assert (
        "peak_mean" not in cells.columns and "gain_peak_mean" not in cells.columns
    )  # in-sample: per run only
    one = summary_by_cell(summary(1))
    assert one["peak_heldout_lo"].isna().all() and one["peak_heldout_hi"].isna().all()


def test_rates_have_wilson_intervals_inside_0_1():
    """A cliff rate over 3 seeds: 1 of 3 is not [-1.10, 1.77] (t-interval) and 0 of 3 is not [0, 0]."""
    p, lo, hi, s = rate_ci([1, 0, 0])
    assert (p, s) == (pytest.approx(1 / 3), 3) and 0 < lo < p < hi < 1
    assert (lo, hi) == (pytest.approx(0.0615, abs=1e-3), pytest.approx(0.7923, abs=1e-3))  # Wilson, z = 1.96
    p, lo, hi, _ = rate_ci([0, 0, 0])
    assert p == 0 and lo == 0 and hi == pytest.approx(0.5615, abs=1e-3)
    recs = summary(3)
    recs.loc[(recs["workflow"] == "voting") & (recs["sharing"] == "ip") & (recs["seed"] > 0), "cliff"] = False
    cells = summary_by_cell(recs)
    for name in ("cliff_rate", "collapse_rate", "stagnation_rate"):
        assert (cells[f"{name}_lo"] >= 0).all() and (cells[f"{name}_hi"] <= 1).all()
    con = contrasts(recs)
    cliff = con[con["stat"] == "cliff"]
    assert (cliff["lo"] >= -1).all() and (cliff["hi"] <= 1).all()


def test_contrasts_paired_by_seed():
    con = contrasts(summary(3))
    assert not con["stat"].isin(["peak", "gain_peak"]).any()  # the in-sample maximum is no contrast
    spip = con[(con["contrast"] == "sp-ip") & (con["workflow"] == "voting") & (con["stat"] == "peak_heldout")]
    spip = spip.iloc[0]
    assert spip["n_pairs"] == 3 and spip["mean"] == pytest.approx(-0.1)
    # the per-seed differences are all -0.1: zero-width CI
    assert spip["lo"] == pytest.approx(-0.1) and spip["hi"] == pytest.approx(-0.1)
    masa = con[(con["contrast"] == "ma-sa") & (con["workflow"] == "eval_opt") & (con["sharing"] == "ip")]
    assert masa[masa["stat"] == "peak_heldout"]["mean"].item() == pytest.approx(0.2)
    assert not (con["workflow"] == "single").any()


def test_per_agent_contrasts_paired_by_seed():
    """sp-agent and ip-agent: SP and IP runs minus the AS run of the same cell and seed; no AS run, no row."""
    recs = summary(3)
    agent = recs[(recs["workflow"] == "voting") & (recs["sharing"] == "ip")].copy()
    agent["sharing"], agent["peak_heldout"] = "agent", agent["peak_heldout"] + 0.05
    con = contrasts(pd.concat([recs, agent], ignore_index=True))
    ph = con[(con["stat"] == "peak_heldout") & (con["contrast"] != "ma-sa")].set_index(
        ["contrast", "workflow"]
    )
    assert ph.loc[("sp-agent", "voting"), "mean"] == pytest.approx(-0.15)
    assert ph.loc[("ip-agent", "voting"), "mean"] == pytest.approx(-0.05)
    assert ph.loc[("ip-agent", "voting"), "n_pairs"] == 3
    assert not ((con["contrast"] == "sp-agent") & (con["workflow"] != "voting")).any()
    assert list(dict.fromkeys(con["contrast"])) == ["sp-ip", "sp-agent", "ip-agent", "ma-sa"]


def test_intervention_minus_none_paired_by_seed():
    """itv-none: each intervention's run minus the none run of the same cell and seed; cells without a none
    run (or none itself) give no pair."""
    recs = summary(3)
    treated = recs[(recs["workflow"] == "voting") & (recs["sharing"] == "ip")].copy()
    treated["intervention"], treated["cliff"] = "cg", [False, False, True]
    treated["terminal_mean3"] = treated["terminal_mean3"] + [0.05, 0.10, 0.15]
    con = contrasts(pd.concat([recs, treated], ignore_index=True))
    itv = con[con["contrast"] == "itv-none"].set_index("stat")
    assert (
        set(itv["workflow"]) == {"voting"}
        and set(itv["sharing"]) == {"ip"}
        and set(itv["intervention"]) == {"cg"}
    )
    assert (itv["n_pairs"] == 3).all()
    assert itv.loc["terminal_mean3", "mean"] == pytest.approx(0.10)
    assert itv.loc["terminal_mean3", "lo"] < 0.10 < itv.loc["terminal_mean3", "hi"]
    assert itv.loc["cliff", "mean"] == pytest.approx(-2 / 3) and itv.loc["cliff", "lo"] >= -1
    assert itv.loc["peak_heldout", "mean"] == pytest.approx(0.0)
    assert list(dict.fromkeys(con["contrast"])) == ["sp-ip", "ma-sa", "itv-none"]


def test_pooled_interventions_are_corrected_and_paired():
    """Two interventions on voting-ip: cg lifts terminal_mean3 by 0.10 +- 0.01 in every seed, kl by nothing
    (+-0.05); each is paired with its none run, intervals at 1 - 0.05/2, verdicts on the primary stat."""
    from marlflow.analysis.seeds import pooled_interventions

    recs = summary(3)
    base = recs[(recs["workflow"] == "voting") & (recs["sharing"] == "ip")]
    cg = base.assign(intervention="cg", terminal_mean3=base["terminal_mean3"] + [0.09, 0.10, 0.11],
                     cliff=[False, False, False])  # fmt: skip
    kl = base.assign(intervention="kl", terminal_mean3=base["terminal_mean3"] + [-0.05, 0.0, 0.05])
    t = pooled_interventions(pd.concat([recs, cg, kl], ignore_index=True)).set_index(["intervention", "stat"])
    assert (t["ci_level"] == 1 - 0.05 / 2).all() and (t["n_pairs"].xs("terminal_mean3", level=1) == 3).all()
    assert t.loc[("cg", "terminal_mean3"), "mean"] == pytest.approx(0.10)
    assert t.loc[("cg", "terminal_mean3"), "verdict"] == "positive"
    assert t.loc[("kl", "terminal_mean3"), "verdict"] == "inconclusive"
    assert t.loc[("cg", "cliff"), "mean"] == -1.0 and t.loc[("cg", "cliff"), "lo"] >= -1
    assert t.loc[("cg", "cliff"), "hi"] > -1.0 and t.loc[("cg", "cliff"), "verdict"] == ""


def test_replicates_are_seed_build_pairs():
    """With a build column each (seed, build) pair is one replicate: 2 seeds x 2 toy builds give 4 per cell,
    SP - IP and intervention - none pair within the same seed and build (pairing by seed alone would cross the
    builds into 8 pairs), and the claims count 4 replicates. Without the column, seeds alone, as before."""
    from marlflow.analysis.seeds import pooled_interventions

    recs = [run(wf, sh, s, build=b, peak=(0.6 if sh == "sp" else 0.7) + 0.01 * s + 0.02 * b, cliff=sh == "ip")
            for s in (0, 1) for b in (0, 1) for wf in ("single", "voting") for sh in ("sp", "ip")
            if (wf, sh) != ("single", "ip")]  # fmt: skip
    df = pd.DataFrame(recs, columns=SUMMARY_COLUMNS)
    cells = summary_by_cell(df)
    assert (cells["n_seeds"] == 4).all() and set(cells["seeds"]) == {"0,0-b1,1,1-b1"}
    con = contrasts(df)
    spip = con[(con["contrast"] == "sp-ip") & (con["stat"] == "peak_heldout")].iloc[0]
    assert spip["n_pairs"] == 4 and spip["mean"] == pytest.approx(-0.1) and spip["hi"] - spip["lo"] < 1e-9
    assert (con[con["contrast"] == "ma-sa"]["n_pairs"] == 4).all()
    kl = df[df["workflow"] == "voting"].assign(intervention="kl")
    pooled = pooled_interventions(pd.concat([df, kl], ignore_index=True))
    assert (pooled["n_pairs"] == 8).all() and (pooled["n_cells"] == 2).all()  # voting sp and ip, 4 each
    c = claims_table(df, grads(2)).set_index("claim")
    assert (c.loc[["C1", "C3", "C4", "C5"], "n_seeds"] == 4).all() and c.loc["C4", "n_cells"] == 4
    seeds_only = df[df["build"] == 0].drop(columns="build")
    assert (summary_by_cell(seeds_only)["n_seeds"] == 2).all()
    assert (contrasts(seeds_only)["n_pairs"] == 2).all()
    c = claims_table(seeds_only, grads(2)).set_index("claim")
    assert (c.loc[["C1", "C3", "C4"], "n_seeds"] == 2).all()


def grads(n_seeds: int) -> pd.DataFrame:
    recs = []
    for s in range(n_seeds):
        for wf, role, amp in (("voting", "generator", 1.6), ("orch_workers", "worker", 1.5),
                              ("eval_opt", "generator", 1.1)):  # fmt: skip
            r = dict.fromkeys(GRAD_COLUMNS, math.nan)
            r.update(run_id=f"{wf}-ip-toy-math-s{s}", workflow=wf, sharing="ip", scale="toy", task="math", seed=s,
                     intervention="none", role=role, slot_amplification_mean=amp + 0.01 * s, dominant=True)  # fmt: skip
            recs.append(r)
            r = dict(r, run_id=f"{wf}-sp-toy-math-s{s}", sharing="sp", drift_corr=0.5 - 0.1 * s)
            recs.append(r)
    return pd.DataFrame(recs, columns=GRAD_COLUMNS)


def test_claims_verdicts():
    c = claims_table(summary(3), grads(3)).set_index("claim")
    assert list(c.index) == [f"C{i}" for i in range(1, 8)]  # one task: no "C3 <task>" rows
    # C1 counts runs: 18 of 18 multi-agent runs escape stagnation, an exact binomial test against 0.5 (the
    # Clopper-Pearson bound 0.00625^(1/18) = 0.754): unanimity over many runs is evidence, not a zero width
    assert c.loc["C1", "value"] == 1.0 and c.loc["C1", "n_cells"] == 18 and c.loc["C1", "ci_hi"] == 1.0
    assert c.loc["C1", "ci_lo"] == pytest.approx(0.00625 ** (1 / 18))
    assert c.loc["C1", "verdict"] == "supported"
    # an IP - SP peak of exactly 0.1 in every seed: a zero-width t-interval, which says nothing about the
    # variance a new seed would show: inconclusive, never supported
    assert c.loc["C3", "value"] == pytest.approx(0.1) and c.loc["C3", "verdict"] == "inconclusive"
    assert math.isnan(c.loc["C3", "mde"])  # no spread across replicates: no power to state
    # 0/1 rates pooled over seeds: C4 paired (9 SP/IP pairs, Tango), C5 independent (6 vs 3 IP runs, Newcombe).
    # C4's 6 discordant pairs all IP-only are not enough at 1 - 0.05/4: even the exact McNemar test gives
    # p = 2 / 2^6 = 0.031 > 0.0125; with 6 seeds (12 of 12) it is supported
    assert c.loc["C4", "value"] == pytest.approx(2 / 3) and c.loc["C4", "verdict"] == "inconclusive"
    assert claims_table(summary(6), grads(6)).set_index("claim").loc["C4", "verdict"] == "supported"
    assert c.loc["C4", "n_cells"] == 9 and -1 <= c.loc["C4", "ci_lo"] < 2 / 3 < c.loc["C4", "ci_hi"] <= 1
    assert (
        c.loc["C5", "value"] == 1.0 and c.loc["C5", "verdict"] == "supported" and c.loc["C5", "ci_hi"] == 1.0
    )
    assert (c.loc[["C1", "C4", "C5"], "mde"] > 0).all() and c.loc[["C2", "C6", "C7"], "mde"].isna().all()
    # statistics not validated to measure their claim are descriptive whatever their interval says
    assert c.loc["C6", "value"] == pytest.approx(0.45) and c.loc["C6", "verdict"] == "descriptive"
    assert c.loc["C7", "value"] == pytest.approx(0.4) and c.loc["C7", "n_seeds"] == 3
    assert set(c[c.verdict == "descriptive"].index) == {"C2", "C6", "C7"} == set(c.index) - set(VALIDATED)
    # Bonferroni over the validated claims, and the toy scope, in every row
    assert (c.loc[list(VALIDATED), "ci_level"] == 1 - 0.05 / len(VALIDATED)).all()
    assert (c["scope"] == "designed environment (toy)").all()
    # one seed: no CI, every verdict inconclusive
    one = claims_table(summary(1), grads(1))
    assert set(one["verdict"]) == {"inconclusive", "descriptive"} and one["ci_lo"].isna().all()


def test_rate_difference_intervals_fit_0_1_data():
    # Newcombe (1998), independent samples, method 10: 56/70 - 48/80 = 0.2, 95% CI [0.0524, 0.3339]
    d, lo, hi, n = rate_diff_ci([1] * 56 + [0] * 14, [1] * 48 + [0] * 32)
    assert (d, n) == (pytest.approx(0.2), 150) and (lo, hi) == (pytest.approx(0.0524, abs=5e-4),
                                                                pytest.approx(0.3339, abs=5e-4))  # fmt: skip
    # 3 of 3 against 0 of 3: a t-interval would be [1, 1]; this one is wide and inside [-1, 1]
    d, lo, hi, _ = rate_diff_ci([1, 1, 1], [0, 0, 0], paired=True)
    assert d == 1.0 and -1 <= lo < 0.5 and hi == 1.0
    # pairs that always agree carry no evidence of a difference
    d, lo, hi, _ = rate_diff_ci([1, 0, 1, 0], [1, 0, 1, 0], paired=True)
    assert d == 0 and lo < 0 < hi


# The rule's family-wise false-verdict rate under the null, the coverage of its intervals and its power:
# tests/test_claims_power.py (10^4+ simulated matrices per seed at three seeds, shaped like the evidence).


def test_c3_per_task_rows():
    """With two tasks, C3 is also given per task (descriptive, at C3's corrected level, with its MDE): a math
    difference is not diluted by code cells that cannot move."""
    recs = summary(3)
    code = recs.assign(task="code", run_id=recs["run_id"] + "-code")
    ip = code["sharing"] == "ip"  # code: IP - SP = 0.02, -0.01, 0 by seed; math: 0.1 in every seed
    code.loc[ip, "peak_heldout"] += code.loc[ip, "seed"].map({0: 0.02, 1: -0.01, 2: 0.0}) - 0.1
    c = claims_table(pd.concat([recs, code], ignore_index=True), grads(3)).set_index("claim")
    assert list(c.index) == ["C1", "C2", "C3", "C3 math", "C3 code", "C4", "C5", "C6", "C7"]
    assert c.loc["C3 math", "value"] == pytest.approx(0.1)
    assert c.loc["C3 code", "value"] == pytest.approx(0.01 / 3)
    assert c.loc["C3", "value"] == pytest.approx(0.1 / 2 + 0.01 / 6)
    assert (c.loc[["C3 math", "C3 code"], "verdict"] == "descriptive").all()
    assert (c.loc[["C3 math", "C3 code"], "ci_level"] == c.loc["C3", "ci_level"]).all()
    assert c.loc["C3 code", "mde"] > 0


def test_verdict_rule():
    assert verdict(0.3, 0.3, 0.0, ">") == "inconclusive"  # zero width: no variance is not certainty
    assert verdict(0.1, 0.3, 0.0, ">") == "supported"
    assert verdict(-0.3, -0.1, 0.0, ">") == "contradicted"
    assert verdict(-0.1, 0.3, 0.0, ">") == "inconclusive"
    assert verdict(np.nan, np.nan, 0.0, ">") == "inconclusive"
    assert verdict(-0.3, -0.1, 0.0, "<") == "supported"


def test_slots_by_cell_keeps_the_parallel_role_and_gives_a_ci_over_runs():
    """The evidence table `slots`: the parallel role's slot amplification and cosine per cell, mean [95% CI]
    over the cell's runs; other roles and workflows without a parallel role are left out."""
    from marlflow.analysis.seeds import SLOT_COLUMNS, slots_by_cell

    rows = []
    for sharing, amps in (("ip", [1.10, 1.20, 1.30]), ("agent", [1.0, 1.0, 1.0])):
        for seed, amp in enumerate(amps):
            base = {"run_id": f"voting-{sharing}-s{seed}", "workflow": "voting", "sharing": sharing, "scale": "toy2",
                    "task": "math", "seed": seed, "build": 0, "intervention": "none"}  # fmt: skip
            rows.append(
                base | {"role": "generator", "slot_amplification_mean": amp, "slot_cos_mean": amp - 1}
            )
            rows.append(base | {"role": "aggregator", "slot_amplification_mean": 9.0, "slot_cos_mean": 9.0})
    rows.append({**rows[0], "run_id": "single", "workflow": "single", "sharing": "sp"})
    out = slots_by_cell(pd.DataFrame(rows))
    assert list(out.columns) == SLOT_COLUMNS and list(out["sharing"]) == ["ip", "agent"]
    assert set(out["role"]) == {"generator"} and list(out["n_runs"]) == [3, 3]
    ip, agent = out.iloc[0], out.iloc[1]
    assert ip["slot_amplification"].startswith("1.200 [") and ip["slot_amplification"] != "1.200 [n/a]"
    assert agent["slot_amplification"].startswith("1.000 [1.000, 1.000]")
    assert slots_by_cell(pd.DataFrame(columns=list(rows[0]))).empty
