"""The step-0 evaluation is computed once per cell and read by the cell's other runs (marlflow.training.base_eval).

What must hold: an IP run's own step-0 evaluation equals its SP sibling's (every metric and sample row but
the factors and wall-clock seconds), so reading it changes nothing; a run that reads it, or that finds it
claimed and fills it in later, ends bit-identical to a run that computed it alone; the cache key follows the
evaluation's inputs and ignores what acts on training only.
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch

from marlflow.cli.train import build_trainer, run
from marlflow.store.schema import FACTOR_COLUMNS, SAMPLE_COLUMNS, VOLATILE_METRICS
from marlflow.training import base_eval


def _step0(trainer) -> tuple[pd.DataFrame, pd.DataFrame]:
    ev = trainer.evaluate_workflow(0, base=True)
    m = pd.DataFrame(ev.metric_rows).drop(columns=FACTOR_COLUMNS)
    s = pd.DataFrame(ev.sample_rows, columns=SAMPLE_COLUMNS).drop(columns=FACTOR_COLUMNS)
    return m[~m.metric.isin(VOLATILE_METRICS)].reset_index(drop=True), s


@pytest.mark.slow
@pytest.mark.parametrize("workflow", ["eval_opt", "voting", "orch_workers"])
def test_ip_step0_evaluation_equals_sp(make_cfg, tmp_path, workflow):
    sp_m, sp_s = _step0(build_trainer(make_cfg(workflow, "sp"), tmp_path / "sp"))
    ip = build_trainer(make_cfg(workflow, "ip"), tmp_path / "ip")
    assert len(ip.cfg.policies) > 1
    ip_m, ip_s = _step0(ip)
    assert (sp_m.metric == "accuracy").any() and len(sp_s) > 0
    pd.testing.assert_frame_equal(sp_m, ip_m)
    pd.testing.assert_frame_equal(sp_s, ip_s)


def _metrics(run_dir) -> pd.DataFrame:
    m = pd.read_parquet(run_dir / "metrics.parquet")
    return m[~m.metric.isin(VOLATILE_METRICS)].reset_index(drop=True)


def _reused(run_dir) -> float:
    m = pd.read_parquet(run_dir / "metrics.parquet")
    return float(m[m.metric == "eval_reused"].value.item())


def _same_run(a, b) -> None:
    """Two runs of one config: equal metrics (timings and eval_reused aside), samples, per-problem outcomes
    and final adapters."""
    pd.testing.assert_frame_equal(_metrics(a), _metrics(b))
    for name in ("samples.parquet", "outcomes.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(a / name), pd.read_parquet(b / name))
    fa, fb = sorted((a / "final").rglob("*.safetensors")), sorted((b / "final").rglob("*.safetensors"))
    assert len(fa) == len(fb) >= 1
    from safetensors.torch import load_file

    for x, y in zip(fa, fb):
        ta, tb = load_file(x), load_file(y)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.slow
def test_runs_of_a_cell_share_step0_and_end_as_if_alone(make_cfg, tmp_path, monkeypatch):
    sp, ip = make_cfg("eval_opt", "sp", steps=2), make_cfg("eval_opt", "ip", steps=2)
    run(ip, tmp_path / "alone" / ip.run_id)  # computes its own step 0
    assert _reused(tmp_path / "alone" / ip.run_id) == 0.0

    cell = tmp_path / "cell"
    run(sp, cell / sp.run_id)
    run(ip, cell / ip.run_id)  # reads the SP run's step 0
    assert (_reused(cell / sp.run_id), _reused(cell / ip.run_id)) == (0.0, 1.0)
    _same_run(tmp_path / "alone" / ip.run_id, cell / ip.run_id)
    step0 = [
        _metrics(cell / r).query("step == 0").drop(columns=FACTOR_COLUMNS) for r in (sp.run_id, ip.run_id)
    ]
    pd.testing.assert_frame_equal(*step0)
    outcomes0 = [
        pd.read_parquet(cell / r / "outcomes.parquet").query("step == 0").drop(columns=FACTOR_COLUMNS)
        for r in (sp.run_id, ip.run_id)
    ]
    assert len(outcomes0[0]) == sp.task.eval_size + sp.task.val_size
    pd.testing.assert_frame_equal(*outcomes0)

    # Another run holds the claim and never writes (it died): the run trains on, then evaluates its initial
    # adapters at its first evaluation, and ends bit-identical to the run alone.
    died = tmp_path / "died"
    shared = base_eval.SharedBaseEval(ip, died)
    assert shared.claim()
    run(ip, died / ip.run_id)
    assert _reused(died / ip.run_id) == 0.0 and shared.metrics.exists() and not shared.claim_path.exists()
    _same_run(tmp_path / "alone" / ip.run_id, died / ip.run_id)

    # The claim holder writes while this run trains: read at the first evaluation.
    later = tmp_path / "later"
    shared = base_eval.SharedBaseEval(ip, later)
    assert shared.claim()
    read, calls = base_eval.SharedBaseEval.read, []

    def read_later(self):
        calls.append(self)
        if len(calls) == 1:
            return None  # at step 0: still being computed
        src = base_eval.SharedBaseEval(ip, cell)  # written by the first evaluation: copy it into place
        self.samples.write_bytes(src.samples.read_bytes())
        self.outcomes.write_bytes(src.outcomes.read_bytes())
        self.metrics.write_bytes(src.metrics.read_bytes())
        return read(self)

    monkeypatch.setattr(base_eval.SharedBaseEval, "read", read_later)
    run(ip, later / ip.run_id)
    assert len(calls) == 2 and _reused(later / ip.run_id) == 1.0
    _same_run(tmp_path / "alone" / ip.run_id, later / ip.run_id)


def test_cache_key_follows_the_evaluations_inputs(make_cfg, tmp_path):
    cfg = make_cfg("voting", "sp")
    k = base_eval.key(cfg)
    same = [
        make_cfg("voting", "ip"),
        make_cfg("voting", "sp", steps=7, learning_rate=3e-3, lora_r=8, temperature=1.3, group_size=2),
        dataclasses.replace(cfg, intervention="srn", intervention_spec={"kind": "same_role_norm"}),
    ]
    assert all(base_eval.key(c) == k for c in same)
    other = [
        make_cfg("eval_opt", "sp"),
        make_cfg("voting", "sp", eval_temperature=0.0),
        make_cfg("voting", "sp", max_completion_length=16),
        dataclasses.replace(cfg, seed=1),
        dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, eval_size=7)),
        dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, val_size=3)),  # step 0 evaluates them too
        dataclasses.replace(cfg, threads=2),
    ]
    assert len({k, *(base_eval.key(c) for c in other)}) == len(other) + 1
    # A rebuilt model (a file rewritten) or an edited local dataset file gives a new key.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "test.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    c = dataclasses.replace(cfg, model=str(model), task=dataclasses.replace(cfg.task, test_file=str(data)))
    k1 = base_eval.key(c)
    (model / "config.json").write_text('{"a": 1}')
    k2 = base_eval.key(c)
    data.write_text('{"question": "1+2", "answer": "3"}\n')
    assert len({k1, k2, base_eval.key(c)}) == 3


def test_an_incomplete_or_unreadable_result_is_computed_anew(make_cfg, tmp_path, caplog):
    cfg = make_cfg("voting", "sp")
    shared = base_eval.SharedBaseEval(cfg, tmp_path)
    rows = [{**cfg.factors, "step": 0, "split": "eval", "role": "all", "metric": "accuracy", "value": 0.5}]
    shared.write(rows, [], SAMPLE_COLUMNS, [])
    got = base_eval.SharedBaseEval(make_cfg("voting", "ip"), tmp_path).read()
    assert got is not None and got[0][0]["sharing"] == "ip" and got[0][0]["value"] == 0.5 and got[1] == []
    assert got[2] == []
    shared.samples.unlink()  # metrics without samples: not a whole result
    assert shared.read() is None
    shared.write(rows, [], SAMPLE_COLUMNS, [])
    shared.outcomes.unlink()  # a result written before outcomes were kept: computed anew
    assert shared.read() is None
    shared.write(rows, [], SAMPLE_COLUMNS, [])
    shared.metrics.write_bytes(b"not parquet")
    assert shared.read() is None and "cannot be read" in caplog.text
