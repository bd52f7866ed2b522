"""Seeds as an axis (summary_by_cell, contrasts) and the claims table, on synthetic summaries with known
answers; plus the t quantiles the CIs use."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from marlflow.analysis import claims_table, contrasts, mean_ci, summary_by_cell
from marlflow.analysis.claims import verdict
from marlflow.analysis.curves import SUMMARY_COLUMNS
from marlflow.analysis.gradients import GRAD_COLUMNS
from marlflow.analysis.stats import rate_ci, t_quantile


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


def run(workflow, sharing, seed, base=0.3, peak=0.7, cliff=False, task="math", stagnation=False):
    rid = f"{workflow}-{sharing}-toy-{task}-s{seed}"
    rec = dict.fromkeys(SUMMARY_COLUMNS, math.nan)
    rec.update(run_id=rid, workflow=workflow, sharing=sharing, scale="toy", task=task, seed=seed,
               intervention="none", base=base, peak=peak, peak_step=20, terminal=peak, terminal_mean3=peak,
               peak_confirmed=peak - 0.01, gain_peak=peak - base, gain_confirmed=peak - 0.01 - base,
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
    assert v["peak_mean"] == pytest.approx(0.71) and v["cliff_rate_mean"] == 1.0
    assert v["peak_lo"] < 0.71 < v["peak_hi"]
    one = summary_by_cell(summary(1))
    assert one["peak_lo"].isna().all() and one["peak_hi"].isna().all()


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
    spip = con[(con["contrast"] == "sp-ip") & (con["workflow"] == "voting") & (con["stat"] == "peak")].iloc[0]
    assert spip["n_pairs"] == 3 and spip["mean"] == pytest.approx(-0.1)
    # the per-seed differences are all -0.1: zero-width CI
    assert spip["lo"] == pytest.approx(-0.1) and spip["hi"] == pytest.approx(-0.1)
    masa = con[(con["contrast"] == "ma-sa") & (con["workflow"] == "eval_opt") & (con["sharing"] == "ip")]
    assert masa[masa["stat"] == "peak"]["mean"].item() == pytest.approx(0.2)
    assert not (con["workflow"] == "single").any()


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
    assert itv.loc["peak", "mean"] == pytest.approx(0.0)
    assert list(dict.fromkeys(con["contrast"])) == ["sp-ip", "ma-sa", "itv-none"]


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
    assert list(c.index) == [f"C{i}" for i in range(1, 8)]
    assert c.loc["C1", "value"] == 1.0 and c.loc["C1", "n_cells"] == 6
    assert c.loc["C3", "value"] == pytest.approx(0.1) and c.loc["C3", "verdict"] == "supported"
    assert c.loc["C4", "value"] == pytest.approx(2 / 3) and c.loc["C4", "verdict"] == "supported"
    assert c.loc["C5", "value"] == 1.0 and c.loc["C5", "verdict"] == "supported"
    assert c.loc["C6", "value"] == pytest.approx(0.45) and c.loc["C6", "verdict"] == "supported"
    assert c.loc["C7", "value"] == pytest.approx(0.4) and c.loc["C7", "n_seeds"] == 3
    # one seed: no CI, every verdict inconclusive
    one = claims_table(summary(1), grads(1))
    assert (one["verdict"] == "inconclusive").all() and one["ci_lo"].isna().all()


def test_verdict_rule():
    assert verdict(0.1, 0.3, 0.0, ">") == "supported"
    assert verdict(-0.3, -0.1, 0.0, ">") == "contradicted"
    assert verdict(-0.1, 0.3, 0.0, ">") == "inconclusive"
    assert verdict(np.nan, np.nan, 0.0, ">") == "inconclusive"
    assert verdict(-0.3, -0.1, 0.0, "<") == "supported"
