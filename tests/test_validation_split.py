"""The validation split (marlflow.tasks.splits, task.val_size): disjoint from the test and training problems,
invisible to training and to the test evaluation, and the only thing cliff_guard reads."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from marlflow.core.config import TaskSpec
from marlflow.store.schema import VOLATILE_METRICS
from marlflow.tasks import get_task, register
from marlflow.tasks.splits import run_splits
from marlflow.tasks.toy import ToyMath, _is_test


@pytest.mark.parametrize("name", ["toy_math", "toy_code"])
def test_splits_are_disjoint_and_training_problems_unchanged(name):
    task = get_task(name)
    spec = TaskSpec(name=name, eval_size=50, train_size=300)
    train0, val0, test0 = run_splits(task, spec)
    train, val, test = run_splits(task, dataclasses.replace(spec, val_size=40))
    assert val0 == [] and train == train0 and test == test0  # validation costs training nothing
    assert len(val) == 40 and len(train) == 300 and len(test) == 50
    prompts = [{p.prompt for p in s} for s in (train, val, test)]
    assert not (prompts[0] & prompts[1]) and not (prompts[1] & prompts[2]) and not (prompts[0] & prompts[2])
    assert not any(_is_test(p.prompt) for p in val)


def test_the_train_command_s_preloaded_task_gives_the_same_splits():
    from marlflow.cli.train import LoadedTask

    spec = TaskSpec(name="toy_math", eval_size=20, train_size=50, val_size=6)
    assert run_splits(LoadedTask(get_task("toy_math"), spec), spec) == run_splits(get_task("toy_math"), spec)


def test_a_task_used_whole_gives_its_tail_to_validation():
    task = get_task("smol_math")
    spec = TaskSpec(name="smol_math", eval_size=8)  # train_size 0: the whole train split trains
    train0, _, _ = run_splits(task, spec)
    train, val, _ = run_splits(task, dataclasses.replace(spec, val_size=10))
    assert train + val == train0 and len(val) == 10
    with pytest.raises(ValueError, match="lower task.val_size"):
        run_splits(task, dataclasses.replace(spec, val_size=len(train0)))


@register("scored")
class _Scored(ToyMath):
    """toy_math whose k-th scoring of the test problems (resp. the validation problems, `held_out`) gives every
    output scores["test"][k] (resp. scores["val"][k]), the last value repeating; training problems score
    output-length parity, so training has reward variance."""

    name = "scored"
    scores: dict = {}
    held_out: frozenset = frozenset()
    calls: dict = {}

    def score(self, problems, outputs):
        test, val = _is_test(problems[0].prompt), problems[0].uid in self.held_out
        if not (test or val):
            return [float(len(o) % 2) for o in outputs]
        split = "test" if test else "val"
        k = self.calls.get(split, 0)
        self.calls[split] = k + 1
        return [self.scores[split][min(k, len(self.scores[split]) - 1)]] * len(outputs)


def _train(make_cfg, tmp_path, task="toy_math", guard=False, scores=None, **task_fields):
    """Metrics of a 3-step single-agent run (eval every step), without run_id, intervention and timings."""
    from marlflow.cli.train import build_trainer

    cfg = make_cfg("single", "sp", task=task, steps=3, eval_every=1, save_every=3)
    cfg = dataclasses.replace(
        cfg, task=dataclasses.replace(cfg.task, **task_fields), generation_dtype="model"
    )
    if guard:
        spec = {"kind": "cliff_guard", "max_restores": 2, "lr_factor": 0.5, "alpha": 0.5, "window": 3}
        cfg = dataclasses.replace(cfg, intervention="cg", intervention_spec=spec, run_id=f"{cfg.run_id}-cg")
    if scores is not None:
        _Scored.scores, _Scored.calls = scores, {}
        _Scored.held_out = frozenset(p.uid for p in run_splits(_Scored(), cfg.task)[1])
    m = build_trainer(cfg, tmp_path / cfg.run_id).fit()
    return m[~m.metric.isin(VOLATILE_METRICS)].drop(columns=["run_id", "intervention"]).reset_index(drop=True)


KEEP = ["step", "split", "role", "metric", "value"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "val, tests, restores",
    [
        ([0.5], ([0.5], [1.0, 0.0]), 0),  # the test split drops (a certain cliff there); validation is flat
        ([1.0, 0.0], ([0.5], [0.0, 1.0]), 2),  # validation drops (twice: max_restores); test flat, or rising
    ],
)
def test_cliff_guard_never_reads_test_outcomes(make_cfg, tmp_path, val, tests, restores):
    """Runs that differ only in what the test problems score. cliff_guard (alpha 0.5, so any drop it saw would
    fire it) selects on validation only, so what it does (guard rows, restores, learning rates, hence
    training and validation accuracy) is the same whatever the test split says."""
    runs = [
        _train(make_cfg, tmp_path / str(i), "scored", guard=True, scores={"val": val, "test": t}, val_size=6)
        for i, t in enumerate(tests)
    ]
    for run, t in zip(runs, tests):
        acc = run[(run.split == "eval") & (run.metric == "accuracy")].value
        assert list(acc) == [t[min(k, len(t) - 1)] for k in range(4)]  # the test scores took effect
        assert set(run[run.split == "val"].step) == {0, 1, 2, 3}
        assert (run.metric == "guard_restore").sum() == restores
    a, b = (r[r.split != "eval"][KEEP].reset_index(drop=True) for r in runs)
    pd.testing.assert_frame_equal(a, b)


def test_validation_changes_neither_training_nor_the_test_evaluation(make_cfg, tmp_path):
    without = _train(make_cfg, tmp_path / "a")
    with_val = _train(make_cfg, tmp_path / "b", val_size=6)
    val = with_val[with_val.split == "val"]
    assert (
        set(val.metric) == {"accuracy", "accuracy_se", "n_eval"}
        and (val[val.metric == "n_eval"].value == 6).all()
    )
    pd.testing.assert_frame_equal(
        without[KEEP].reset_index(drop=True), with_val[with_val.split != "val"][KEEP].reset_index(drop=True)
    )
