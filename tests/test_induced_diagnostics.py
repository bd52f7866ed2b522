"""Each diagnostic fires on a phenomenon induced by construction in a real toy training run and stays quiet
on the matched null run (issue 37, item 3); `pytest -k induced` selects these tests.

The runs are tests/induced/cases.py's: a cell of the toy preset (the shipped model results/models/toy) at a
smaller scale, trained by the project's trainer in this process; the inducers are plug-ins registered the
documented way (MARLFLOW_WORKFLOWS / MARLFLOW_INTERVENTIONS); the diagnostics are read with the project's
analysis code (analysis.failures, analysis.paired, analysis.gradients). The same cases over several seeds are
results/evidence/diagnostics/ (benchmarks/diagnostics/induced.py), whose table the last test recomputes from
the committed parquet.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from induced import cases

from marlflow.core import algos
from marlflow.core import intervention_spec as ispec
from marlflow.core import workflow_spec as wspec

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "results" / "evidence" / "diagnostics"
# What results/evidence/diagnostics measured (docs/diagnostics.md): per diagnostic, the induced runs' flag
# rate at least and the null runs' flag rate at most, over the committed seeds.
DOCUMENTED = {
    "cliff": (1.0, 0.0),
    "cliff_paired": (1.0, 0.0),
    "collapse": (1.0, 0.0),
    "stagnation": (1.0, 0.0),
    "capture": (1.0, 0.0),
    "amplification": (1.0, 0.0),
    "cross_role": (1.0, 0.0),
}
MIN_SEEDS = 3


@pytest.fixture
def plugins(monkeypatch):
    """The inducers registered as any plug-in is (modules named in the environment), for this test only."""
    monkeypatch.setattr(wspec, "_REGISTERED", {})
    monkeypatch.setattr(ispec, "_REGISTERED", {})
    for var, mods in cases.PLUGINS.items():
        monkeypatch.setenv(var, mods)
    monkeypatch.syspath_prepend(str(cases.TESTS))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One folder for the module's runs: runs of one cell share its step-0 evaluation (training.base_eval)."""
    return tmp_path_factory.mktemp("induced")


@pytest.fixture(scope="module")
def single_null(runs) -> Path:
    """The null run of cliff, collapse and stagnation (no plug-in), trained once for the three tests."""
    return _train(cases.SINGLE_NULL, runs)


def _train(spec: cases.RunSpec, runs: Path, seed: int = 0) -> Path:
    cfg = cases.config(spec, seed)
    return cases.train(cfg, runs / cfg.run_id)


def _read(diagnostic: str, run: Path) -> tuple[bool, dict[str, float]]:
    rows = cases.readout(diagnostic, run)
    return rows[0]["flag"], {r["metric"]: r["value"] for r in rows}


def _accuracy(run: Path) -> dict[int, float]:
    m = cases.metrics(run)
    sel = m[(m.split == "eval") & (m.role == "all") & (m.metric == "accuracy")]
    return sel.set_index("step").value.sort_index().to_dict()


@pytest.mark.slow
def test_cliff_induced_by_a_learning_rate_spike(plugins, runs, single_null):
    """Both cliff tests: the calibrated curve test (stats.curve_tests), the paired one (analysis.paired)."""
    run = _train(cases.SINGLE_SPIKE, runs)
    m = cases.metrics(run)
    lr = m[(m.split == "train") & (m.metric == "lr")].set_index("step").value
    assert lr[6] == pytest.approx(2e-3) and lr[7] == pytest.approx(0.1)  # x 50 after step 6's evaluation
    acc = _accuracy(run)
    assert max(acc[2], acc[4], acc[6]) > acc[0], acc  # it rose before the spike: there is a peak to fall from
    for diagnostic in ("cliff", "cliff_paired"):
        flag, v = _read(diagnostic, run)
        assert flag and v["drop"] >= 0.2, (diagnostic, v, acc)
        flag, v = _read(diagnostic, single_null)
        assert not flag, (diagnostic, v, _accuracy(single_null))


@pytest.mark.slow
def test_collapse_induced_by_a_reward_paying_wrong_answers(plugins, runs, single_null):
    run = _train(cases.SINGLE_WRONG, runs)
    flag, v = _read("collapse", run)
    assert flag and v["base_minus_terminal3"] >= 0.1, _accuracy(run)
    flag, v = _read("collapse", single_null)
    assert not flag and v["base_minus_terminal3"] < 0, _accuracy(single_null)


@pytest.mark.slow
def test_stagnation_induced_by_a_learning_rate_near_zero(plugins, runs, single_null):
    run = _train(cases.SINGLE_FROZEN, runs)
    flag, v = _read("stagnation", run)
    assert flag and abs(v["peak_minus_base"]) < 0.05, _accuracy(run)
    flag, v = _read("stagnation", single_null)
    assert not flag, _accuracy(single_null)


@pytest.mark.slow
def test_capture_induced_by_paying_only_the_producers_of_a_shared_policy(plugins, runs):
    flag, v = _read("capture", _train(cases.CAPTURE_SP, runs))
    assert flag, v
    flag, v = _read("capture", _train(cases.CAPTURE_IP, runs))
    assert not flag, v


def test_slot_amplification_induced_by_parallel_slots_sharing_one_sample(plugins, runs):
    flag, v = _read("amplification", _train(cases.VOTING_SHARED, runs))
    assert flag and v["slot_amplification"] == pytest.approx(math.sqrt(cases.N_VOTES), abs=1e-3), v
    assert v["slot_cos"] == pytest.approx(1.0, abs=1e-3)
    flag, v = _read("amplification", _train(cases.VOTING_NULL, runs))
    assert not flag and v["slot_amplification"] < 1.2, v


def test_cross_role_cosine_induced_by_roles_with_identical_calls(plugins, runs):
    flag, v = _read("cross_role", _train(cases.EVAL_OPT_ECHO, runs))
    assert flag and v["cos_others"] == pytest.approx(1.0, abs=1e-3), v
    flag, v = _read("cross_role", _train(cases.EVAL_OPT_NULL, runs))
    assert not flag and abs(v["cos_others"]) < 0.3, v


def test_grad_scale_minus_one_is_the_update_of_a_reward_paying_wrong_answers():
    """GRPO advantages of the reward 1 - r are -A(r) (group normalisation), so negating every role's gradient
    (induced.grad_scale, factor -1) is the update of the reward that pays wrong answers."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])  # group 2 has no reward variance
    a, _ = algos.group_advantages(r, index)
    flipped, _ = algos.group_advantages(1 - r, index)
    assert torch.equal(flipped, -a) and a.abs().sum() > 0


def _script():
    spec = importlib.util.spec_from_file_location("induced_bench", ROOT / "benchmarks/diagnostics/induced.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_induced_diagnostics_table_is_recomputed_from_the_committed_runs():
    """table.md is what benchmarks/diagnostics/induced.py makes of the committed parquet, byte for byte, and
    docs/diagnostics.md quotes it; every diagnostic has >= 3 seeds per case and the documented flag rates."""
    script = _script()
    df = pd.read_parquet(EVIDENCE / "diagnostics.parquet")
    assert list(df.columns) == script.COLUMNS
    table = script.table(df)
    assert table == (EVIDENCE / "table.md").read_text()
    assert table in (ROOT / "docs" / "diagnostics.md").read_text()
    seeds = df.drop_duplicates(["diagnostic", "case", "seed"]).groupby(["diagnostic", "case"]).size()
    assert set(seeds.index) == {(d, c) for d in DOCUMENTED for c in ("induced", "null")}
    assert (seeds >= MIN_SEEDS).all(), seeds
    rates = script.flag_rates(df)
    for diagnostic, (induced_at_least, null_at_most) in DOCUMENTED.items():
        assert rates[(diagnostic, "induced")] >= induced_at_least, diagnostic
        assert rates[(diagnostic, "null")] <= null_at_most, diagnostic
