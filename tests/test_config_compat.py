"""Fields added to RunConfig leave existing runs' config.json byte for byte as they were.

Snakemake reruns a train job whose params (the config JSON) change, and checkpoints and the step-0 cache are
keyed on it, so a new field must not appear in the config of a run that leaves it at its default
(flag omitted_at_default in its metadata: config.fields_with), and a config.json without it must load with the
default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pytest

from marlflow.core.config import GRPOParams, RunConfig, TaskSpec, fields_with
from marlflow.pipeline.matrix import run_sheet

MATRIX = Path(__file__).resolve().parents[1] / "matrix.yaml"

# sha256 of "run_id config_json" lines of every cell of each preset, as the code at d6df1a0
# wrote them: `run_sheet(matrix.yaml, preset)["config"]`. If a preset is changed on purpose, its finished
# runs will be retrained: update the hash only then, and say so in the commit. toy, smoke, toy_seeds and
# toy_interventions changed on purpose at 9ee740a (task.val_size: a validation set) and again when the toy
# preset set sampling_seeds per_call (the toy evidence was regenerated with it); smol still checks that a
# TaskSpec field at its default (val_size 0) leaves config.json as it was. The hashes cover build-0 runs: the
# build axis (toy_seeds' build 1) added runs, and must leave every run that existed before it as it was.
BEFORE = {
    "toy": "ce3d5ba774bd50f9f10afeeed230e2cc4163b919d6908e27918e641e0fa87908",
    "smoke": "20766b269acf94891b86e64135aee253119a31b6bf8d8187246d5b8e2e9b590f",
    "toy_seeds": "7630bfaa70b07e44ef757f82c36ba25b7ecf54b3a445ee36ced356a3868be99c",
    "smol": "a775cd8edf3147be268e60f1c1015d9d5ed96f331145702af7d9dfb65805b205",
    "toy_interventions": "54ffaee1de656d2b5d9dd3540067097c225df66d2e1ed73fde5b8afece2f7f2f",
}


@pytest.mark.parametrize("preset", sorted(BEFORE))
def test_config_json_of_existing_presets_is_unchanged(preset):
    sheet = run_sheet(MATRIX, preset)
    sheet = sheet[sheet["build"] == 0]
    blob = "\n".join(f"{rid} {c}" for rid, c in sheet["config"].items())
    assert hashlib.sha256(blob.encode()).hexdigest() == BEFORE[preset]


def _cfg(**kw):
    return RunConfig(run_id="r", workflow="voting", sharing="sp", scale="toy", task_axis="math", seed=0,
                     task=TaskSpec(name="toy_math"), model="m", **kw)  # fmt: skip


def test_omitted_fields_are_absent_at_default_and_present_otherwise():
    d = _cfg().to_dict()
    names = {f.name for f in dataclasses.fields(RunConfig)}
    assert set(d) == names - set(fields_with(RunConfig, "omitted_at_default"))
    assert set(d["task"]) == {f.name for f in dataclasses.fields(TaskSpec)} - {"val_size"}
    assert RunConfig.from_dict(json.loads(json.dumps(d))) == _cfg()  # absent keys load as the defaults
    changed = _cfg(max_chunk_tokens=40_960, gradient_checkpointing="on", report_to=["tensorboard"])
    d = changed.to_dict()
    assert d["max_chunk_tokens"] == 40_960 and d["gradient_checkpointing"] == "on"
    assert d["report_to"] == ["tensorboard"] and "vllm_sleep" not in d
    assert RunConfig.from_dict(json.loads(json.dumps(d))) == changed


def test_gradient_checkpointing_auto_is_on_at_hub_scales():
    assert not _cfg().use_gradient_checkpointing
    assert _cfg(gradient_checkpointing="on").use_gradient_checkpointing
    for scale, on in (("smol", False), ("0.6b", True), ("1.7b", True), ("4b", True)):
        assert dataclasses.replace(_cfg(), scale=scale).use_gradient_checkpointing == on
        assert not dataclasses.replace(
            _cfg(gradient_checkpointing="off"), scale=scale
        ).use_gradient_checkpointing


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"gradient_checkpointing": "yes"}, "gradient_checkpointing is 'yes'; allowed values: auto, on, off"),
        ({"max_chunk_tokens": -1}, "max_chunk_tokens is -1; it must be >= 0"),
        ({"max_chunk_tokens": 4096.0}, "max_chunk_tokens is 4096.0 of type float, but it must be an integer"),
        ({"n_votes": 10}, "n_votes is 10; it must be >= 1 and <= 9 (the aggregator answers with one digit)"),
        (
            {"grpo": {"temperature": 0.0}},
            "grpo.temperature is 0.0; it must be > 0 and <= 10 (rollouts must sample)",
        ),
        (
            {"grpo": {"epsilon": 0.3, "epsilon_high": 0.2}},
            "grpo.epsilon_high (0.2) is below grpo.epsilon (0.3)",
        ),
    ],
)
def test_bad_values_name_the_field(kw, message):
    """One range check per field (its bounds and bound_note in the field's metadata); cross-field rules in
    __post_init__."""
    from marlflow.core.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        _cfg(**{k: GRPOParams(**v) if k == "grpo" else v for k, v in kw.items()})
