"""Per-problem outcomes and the paired inference built on them.

- A real toy run writes outcomes.parquet: one row per (step, split, problem) for every evaluation, step 0
  included; its accuracies are the metrics' accuracies; Voting rows carry their candidates.
- marlflow.core.paired: exact McNemar against hand-computed binomial tails; the paired interval of one
  replicate is the paired t over problems; under the null (two arms of equal skill on shared problems, seeds
  with their own effect) the interval's coverage is within 1 point of nominal or above it, and with a real
  difference it detects it.
- marlflow.analysis.paired: an SP-IP difference built into outcomes is found by the paired table and a null one
  is not; the paired cliff test fires on a run whose terminal loses problems it solved at its peak and stays
  quiet on a run that does not; `marlflow aggregate` writes the tables from outcomes beside the metrics.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from marlflow.analysis.paired import check_declared, paired_cliffs, paired_contrasts
from marlflow.core.paired import mcnemar_exact, paired_diff
from marlflow.store.schema import OUTCOME_COLUMNS, outcomes_frame


def test_mcnemar_exact_matches_the_binomial_tails():
    # n10 = 10, n01 = 2: P(X >= 10 | n = 12, 1/2) = (66 + 12 + 1) / 4096
    assert mcnemar_exact(10, 2, "greater") == pytest.approx(79 / 4096)
    assert mcnemar_exact(10, 2) == pytest.approx(2 * 79 / 4096)
    assert mcnemar_exact(2, 10, "less") == pytest.approx(79 / 4096)
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(5, 5) == 1.0
    with pytest.raises(ValueError, match="alternative"):
        mcnemar_exact(1, 2, "bigger")


def test_one_replicate_is_the_paired_t_over_problems():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    s = paired_diff(a, b)
    d = a - b
    assert s["diff"] == pytest.approx(d.mean())
    assert s["se"] == pytest.approx(d.std(ddof=1) / math.sqrt(200))
    assert s["n_rep"] == 1 and s["n_prob"] == 200 and s["df"] == 199
    assert s["n10"] == int(((a == 1) & (b == 0)).sum())
    with pytest.raises(ValueError, match="same"):
        paired_diff(a[:10], b[:11])


def _crossed(rng, sims: int, r: int, p: int, delta: float, seed_sd: float):
    """(sims, r, p) outcomes of two arms on p shared problems (difficulty logits N(0, 1.5)) over r replicates
    (a seed effect per arm and replicate, N(0, seed_sd)); arm a's logit is shifted by delta."""
    u = rng.normal(0, 1.5, (sims, 1, p))
    sa, sb = rng.normal(0, seed_sd, (sims, r, 1)), rng.normal(0, seed_sd, (sims, r, 1))
    pa, pb = 1 / (1 + np.exp(-(u + sa + delta))), 1 / (1 + np.exp(-(u + sb)))
    return (rng.random((sims, r, p)) < pa).astype(float), (rng.random((sims, r, p)) < pb).astype(float)


@pytest.mark.parametrize("r,seed_sd", [(1, 0.0), (2, 0.3), (3, 0.6), (6, 0.0), (6, 0.3), (6, 0.6)])
def test_paired_interval_holds_its_level_under_the_null(r, seed_sd):
    # Equal arms: the true difference is 0 for any problems and seeds, so coverage = 1 - false verdicts.
    rng = np.random.default_rng(7 + r)
    sims = 2000
    a, b = _crossed(rng, sims, r, 200, 0.0, seed_sd)
    covered = [(s := paired_diff(a[i], b[i]))["lo"] <= 0 <= s["hi"] for i in range(sims)]
    rate = float(np.mean(covered))
    mc = math.sqrt(0.95 * 0.05 / sims)  # Monte Carlo SE of a 95% coverage estimate
    assert rate >= 0.95 - 0.01 - 2 * mc, rate


def test_paired_interval_detects_a_real_difference():
    rng = np.random.default_rng(3)
    a, b = _crossed(rng, 200, 6, 200, 0.8, 0.0)  # about 12 points better on average, no seed effect
    hits = np.mean([paired_diff(a[i], b[i])["lo"] > 0 for i in range(200)])
    assert hits > 0.9
    # with seed effects, 6 replicates leave 5 degrees of freedom for them: the interval widens, power drops
    a, b = _crossed(rng, 200, 6, 200, 0.8, 0.3)
    assert np.mean([paired_diff(a[i], b[i])["lo"] > 0 for i in range(200)]) < hits


def _outcomes(run_id, workflow, sharing, seed, steps_correct: dict[int, np.ndarray], split="eval"):
    rows = []
    for step, correct in steps_correct.items():
        for k, c in enumerate(correct):
            rows.append({"run_id": run_id, "workflow": workflow, "sharing": sharing, "scale": "toy",
                         "task": "math", "seed": seed, "build": 0, "intervention": "none", "step": step,
                         "split": split, "uid": f"p{k}", "reward": float(c), "correct": bool(c),
                         "completion_tokens": 10, "calls": 4, "truncated_calls": 0, "format_failures": 0,
                         "finish_reason": "stop", "candidates": 3, "candidates_correct": int(c),
                         "rounds": 1})  # fmt: skip
    return rows


def _summary(runs: dict[str, int]) -> pd.DataFrame:
    return pd.DataFrame({"run_id": list(runs), "peak_heldout_step": pd.array(list(runs.values()), "Int64")})


def test_paired_table_finds_a_built_in_difference_and_not_a_null_one():
    rng = np.random.default_rng(1)
    rows, runs = [], {}
    easy = rng.random(200)  # each problem's chance of being solved, shared by every seed and arm
    for seed in range(6):
        base = rng.random(200) < easy
        null_arm = rng.random(200) < easy  # the same skill, drawn again
        better = base | (rng.random(200) < 0.3)  # SP solves what IP solves and more
        for wf, (sp_correct, ip_correct) in (("voting", (better, base)), ("orch_workers", (null_arm, base))):
            rows += _outcomes(f"{wf}-sp-s{seed}", wf, "sp", seed, {0: base, 10: sp_correct})
            rows += _outcomes(f"{wf}-ip-s{seed}", wf, "ip", seed, {0: base, 10: ip_correct})
            runs |= {f"{wf}-sp-s{seed}": 10, f"{wf}-ip-s{seed}": 10}
    pairs = paired_contrasts(outcomes_frame(rows), _summary(runs))
    got = pairs.set_index(["at", "workflow"])
    assert got.loc[("heldout", "voting"), "verdict"] == "sp higher"
    assert got.loc[("heldout", "orch_workers"), "verdict"] == "no difference shown"
    assert got.loc[("heldout", "voting"), "n_rep"] == 6 and got.loc[("heldout", "voting"), "n_prob"] == 200
    assert (pairs.loc[pairs["at"] == "terminal", "verdict"] == "descriptive").all()
    # Bonferroni over the 3 primary rows (voting, orch_workers, all)
    assert got.loc[("heldout", "voting"), "ci_level"] == pytest.approx(1 - 0.05 / 3)


def test_per_agent_contrasts_pair_agent_runs_with_sp_and_ip():
    """sp-agent and ip-agent: the AS run of a cell against its SP and IP runs of the same seed, problem by
    problem; a built-in AS gain is found against both, and sp-ip (equal arms) shows none. The three
    contrasts' primary rows share one Bonferroni correction."""
    rng = np.random.default_rng(3)
    rows, runs = [], {}
    easy = rng.random(200)
    for seed in range(6):
        base = rng.random(200) < easy
        arms = {"sp": base, "ip": rng.random(200) < easy, "agent": base | (rng.random(200) < 0.3)}
        for sh, correct in arms.items():
            rows += _outcomes(f"voting-{sh}-s{seed}", "voting", sh, seed, {0: base, 10: correct})
            runs[f"voting-{sh}-s{seed}"] = 10
    pairs = paired_contrasts(outcomes_frame(rows), _summary(runs))
    got = pairs[pairs["workflow"] == "voting"].set_index(["contrast", "at"])
    assert got.loc[("sp-agent", "heldout"), "verdict"] == "agent higher"
    assert got.loc[("ip-agent", "heldout"), "verdict"] == "agent higher"
    assert got.loc[("sp-ip", "heldout"), "verdict"] == "no difference shown"
    assert (got.loc[("sp-agent", "heldout"), "a"], got.loc[("sp-agent", "heldout"), "b"]) == ("sp", "agent")
    assert got.loc[("sp-agent", "heldout"), "ci_level"] == pytest.approx(1 - 0.05 / 6)  # 3 contrasts x 2 rows


def test_paired_cliff_fires_on_lost_problems_and_not_on_noise():
    rng = np.random.default_rng(2)
    peak = rng.random(200) < 0.6
    lost = peak & (rng.random(200) < 0.3)  # the terminal loses ~18 points of what the peak solved
    noise = peak ^ (rng.random(200) < 0.04)  # flips a few either way
    rows = _outcomes("cliffy", "voting", "sp", 0, {0: peak, 20: peak, 40: peak & ~lost})
    rows += _outcomes("flat", "voting", "ip", 0, {0: peak, 20: peak, 40: noise})
    cliffs = paired_cliffs(outcomes_frame(rows), _summary({"cliffy": 20, "flat": 20})).set_index("run_id")
    assert cliffs.loc["cliffy", "cliff_paired"] and cliffs.loc["cliffy", "p"] < 1e-6
    assert not cliffs.loc["flat", "cliff_paired"]
    assert cliffs.loc["cliffy", "corr"] > 0.4  # the two evaluations are correlated, and the test uses it
    assert (cliffs.loc["cliffy", "peak_step"], cliffs.loc["cliffy", "terminal_step"]) == (20, 40)


def test_declaration_errors_name_the_field():
    check_declared({"contrasts": ["sp-ip"], "primary": "terminal", "mde": 0.1})
    for bad, field in [({"contrasts": ["sp-xx"]}, "contrasts"), ({"primary": "peak"}, "primary"),
                       ({"alpha": 2}, "alpha"), ({"mde": -1}, "mde"), ({"pairs": 1}, "unknown")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            check_declared(bad)


def test_outcomes_of_a_real_run(make_cfg, tmp_path):
    """A real toy Voting run: outcomes.parquet has every evaluation's problems, test and validation, step 0
    included, and its mean reward per (step, split) is the logged accuracy."""
    import dataclasses

    from marlflow.cli.train import run

    cfg = make_cfg("voting", "ip", steps=2, max_completion_length=24)
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, val_size=4))
    metrics = run(cfg, tmp_path / cfg.run_id)
    o = pd.read_parquet(tmp_path / cfg.run_id / "outcomes.parquet")
    assert list(o.columns) == OUTCOME_COLUMNS
    sizes = o.groupby(["step", "split"]).size().to_dict()
    assert sizes == {(s, sp): n for s in (0, 1, 2) for sp, n in (("eval", 6), ("val", 4))}
    acc = metrics[(metrics.metric == "accuracy") & (metrics.role == "all")].set_index(["step", "split"])[
        "value"
    ]
    pd.testing.assert_series_equal(
        o.groupby(["step", "split"])["reward"].mean(), acc.sort_index(), check_names=False
    )
    test = o[o.split == "eval"]
    assert (test.candidates == cfg.n_votes).all() and (test.candidates_correct <= test.candidates).all()
    assert (o.correct == (o.reward >= 1.0)).all() and (o.calls == cfg.n_votes + 1).all()
    assert set(o.finish_reason) <= {"stop", "length"}
    assert ((o.finish_reason == "length") == (o.truncated_calls > 0)).all()

    # `marlflow aggregate` reads the outcomes beside the metrics and writes the paired tables
    out = tmp_path / "tables"
    subprocess.run([sys.executable, "-m", "marlflow", "aggregate", "--runs",
                    str(tmp_path / cfg.run_id / "metrics.parquet"), "--out", str(out)], check=True)  # fmt: skip
    cliffs = pd.read_csv(out / "paired_cliffs.csv")
    assert list(cliffs.run_id) == [cfg.run_id] and cliffs.terminal_step.item() == 2
    assert (out / "paired.md").read_text().startswith("Per-problem paired differences")


def test_findings_name_per_problem_verdicts_from_the_declared_rows():
    """The report's findings line on per-problem SP - IP reads the declared primary rows of paired.csv: a cell
    with a difference is named with its interval, and when none has one the line says so with the largest."""
    from marlflow.report.findings import per_problem_line

    rng = np.random.default_rng(1)
    rows, runs = [], {}
    easy = rng.random(200)
    for seed in range(6):
        base = rng.random(200) < easy
        better = base | (rng.random(200) < 0.3)
        rows += _outcomes(f"v-sp-s{seed}", "voting", "sp", seed, {0: base, 10: better})
        rows += _outcomes(f"v-ip-s{seed}", "voting", "ip", seed, {0: base, 10: base})
        runs |= {f"v-sp-s{seed}": 10, f"v-ip-s{seed}": 10}
    pairs = paired_contrasts(outcomes_frame(rows), _summary(runs))
    line = per_problem_line(pairs)
    assert "voting math: sp higher" in line and "2 rows at 0.975 each" in line
    null = pairs.assign(verdict=pairs["verdict"].where(pairs["at"] != "heldout", "no difference shown"))
    assert "no difference shown in any (largest: " in per_problem_line(null)
    assert per_problem_line(None) is None and per_problem_line(pairs.iloc[0:0]) is None


@pytest.mark.parametrize(("n_rep", "says"), [(1, "One replicate"), (6, "Several replicates")])
def test_paired_caption_says_what_the_interval_covers(n_rep, says):
    """paired.md's caption follows the table: with one replicate per pair the interval covers the problems only;
    with several it covers replicate variance too."""
    from marlflow.analysis.paired import PAIRED_COLUMNS, paired_markdown

    row = {c: 0.0 for c in PAIRED_COLUMNS} | {"contrast": "sp-ip", "a": "sp", "b": "ip", "at": "heldout",
                                               "workflow": "voting", "n_rep": n_rep, "n_prob": 200}  # fmt: skip
    text = paired_markdown(pd.DataFrame([row], columns=PAIRED_COLUMNS))
    assert says in text and ("One replicate" in text) == (n_rep == 1)
