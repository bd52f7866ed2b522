"""The user path's silent traps of issue 28, one test each: what used to be accepted quietly now fails
loudly (or is done right), with a message that names the fix.

The eval budget traps are in tests/test_cli.py (they reuse its trained run).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


# ---------------------------------------------------------------- adapters name their base portably


def test_adapters_name_the_base_relative_to_the_root_and_load_in_another_copy(
    toy_model_dir, tmp_path, monkeypatch
):
    """A 1-step run trained in clone A (base: results/models/toy), copied to B, A deleted: the checkpoint's and
    final/'s adapters load with plain PEFT in B and resolve B's base. Before: they named A's absolute folder."""
    from peft import AutoPeftModelForCausalLM

    from marlflow.config import GRPOParams, RunConfig, TaskSpec
    from marlflow.train import run

    clone_a, clone_b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(toy_model_dir, clone_a / "results" / "models" / "toy")
    params = dict(steps=1, problems_per_step=1, group_size=2, learning_rate=1e-2, warmup_steps=0,
                  lr_scheduler="constant", eval_every=1, save_every=1, max_completion_length=8,
                  max_prompt_length=256, lora_r=4, lora_alpha=8)  # fmt: skip
    cfg = RunConfig(run_id="single-sp-toy-math-s0", workflow="single", sharing="sp", scale="toy",
                    task_axis="math", seed=0, task=TaskSpec(name="toy_math", eval_size=2, train_size=10),
                    model="results/models/toy", grpo=GRPOParams(**params))  # fmt: skip
    rel_run = Path("results/runs") / cfg.run_id
    monkeypatch.chdir(clone_a)
    run(cfg, rel_run)
    shutil.copytree(clone_a, clone_b)
    shutil.rmtree(clone_a)  # nothing may point back at the clone that trained it
    monkeypatch.chdir(clone_b)
    final = rel_run / "final" / "shared"
    for folder in (final, rel_run / "checkpoints" / "step-1" / "adapters" / "shared"):
        conf = json.loads((folder / "adapter_config.json").read_text())
        assert conf["base_model_name_or_path"] == "results/models/toy", folder
    model = AutoPeftModelForCausalLM.from_pretrained(str(final))
    assert (
        Path(model.base_model.model.config._name_or_path).resolve()
        == (clone_b / "results" / "models" / "toy").resolve()
    )
    for card in (rel_run / "final" / "README.md", final / "README.md"):
        text = card.read_text()
        front = text.split("---\n")[1]
        assert 'base_model: "results/models/toy"' in front.splitlines(), front
        assert str(tmp_path) not in text  # no absolute folder of either clone
