"""Shared fixtures: a toy model built offline once per session, and a run-config factory."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def toy_model_dir(tmp_path_factory):
    """A toy model with a short warm start: real tokenizer, chat template and weights, built here."""
    from marlflow.models.toybuild import build_toy

    out = tmp_path_factory.mktemp("toy-model")
    build_toy(out, seed=0, steps=40, batch_size=16, eval_n=0, solve_steps=0)
    return out


@pytest.fixture
def make_cfg(toy_model_dir):
    from marlflow.core.config import GRPOParams, RunConfig, TaskSpec

    def make(workflow="voting", sharing="ip", task="toy_math", steps=2, **grpo):
        params = dict(steps=steps, problems_per_step=2, group_size=4, learning_rate=1e-2, warmup_steps=0,
                      lr_scheduler="constant", eval_every=1, save_every=1, max_completion_length=12,
                      max_prompt_length=256, lora_r=4, lora_alpha=8)  # fmt: skip
        params.update(grpo)
        axis = "code" if "code" in task else "math"
        return RunConfig(
            run_id=f"{workflow}-{sharing}-toy-{axis}-s0",
            workflow=workflow,
            sharing=sharing,
            scale="toy",
            task_axis=axis,
            seed=0,
            task=TaskSpec(name=task, eval_size=6, train_size=50),
            model=str(toy_model_dir),
            grpo=GRPOParams(**params),
        )

    return make


@pytest.fixture
def preempt_installed():
    """marlflow.training.preempt's handlers installed on a clean state; the process's own handlers put back after."""
    import signal

    from marlflow.training import preempt

    saved = {s: signal.getsignal(s) for s in preempt.SIGNALS}
    preempt.reset()
    preempt.install()
    try:
        yield preempt
    finally:
        preempt.reset()
        for s, h in saved.items():
            signal.signal(s, h)
