"""Each config fact has one home: the field's own metadata (marlflow.core.config), and one AXES table
(marlflow.pipeline.matrix) for the matrix's axes.

What a field's metadata says is what every reader does: the range check and the matrix schema read its
bounds and enum, config.json its omitted_at_default flag, the fingerprint its provenance flag, the shared
step-0 evaluation's key its training_only flag, the schema of a preset's `run:` its not_run_level flag. Lists
of axis names kept elsewhere (the metrics' factor columns, the analysis's cell and replicate keys) are
checked against AXES, and `test_a_new_axis` adds an axis to a copy of the matrix module to show what adding
one takes. Run: `pytest -q tests/test_config_fields.py`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from marlflow.core import config as C
from marlflow.core.config import ConfigError, GRPOParams, RunConfig, TaskSpec
from marlflow.pipeline import matrix as M

MATRIX = Path(__file__).resolve().parents[1] / "matrix.yaml"
CLASSES = (TaskSpec, GRPOParams, RunConfig)


def _cfg(**kw) -> RunConfig:
    return RunConfig(run_id="r", workflow="voting", sharing="sp", scale="toy", task_axis="math", seed=0,
                     task=TaskSpec(name="toy_math"), model="m", **kw)  # fmt: skip


def test_every_field_carries_help_and_only_known_facts():
    for cls in CLASSES:
        for f in dataclasses.fields(cls):
            assert len(C.help_of(cls, f.name)) > 10, (cls.__name__, f.name)
            assert set(f.metadata) <= {*C.FACT_KEYS, *C.FLAGS}, (cls.__name__, f.name, set(f.metadata))
            if "enum" in f.metadata:
                assert C.enum_of(cls, f.name) and all(isinstance(v, str) for v in C.enum_of(cls, f.name))
    with pytest.raises(KeyError, match="not a config field flag"):
        C.fields_with(RunConfig, "provenence")


def test_a_field_brings_its_own_range_enum_and_help_to_every_reader():
    """A bounded, enumerated field added to a config class is range-checked and enum-checked on construction
    and appears in the matrix schema, with nothing else edited."""

    @dataclass(frozen=True)
    class Extra(GRPOParams):
        rollout_batches: int = field(default=2, metadata={"help": "rollout batches per step (an example).",
                                                          "bounds": {"minimum": 1, "maximum": 8},
                                                          "bound_note": "memory"})  # fmt: skip
        sampler: str = field(default="a", metadata={"help": "an example sampler choice.", "enum": ("a", "b")})

    assert Extra().rollout_batches == 2
    with pytest.raises(ConfigError, match=r"grpo\.rollout_batches is 9; it must be >= 1 and <= 8 \(memory\)"):
        Extra(rollout_batches=9)
    with pytest.raises(ConfigError, match="grpo.sampler is 'c'; allowed values: a, b"):
        Extra(sampler="c")
    props = M._fields_schema(Extra)
    assert props["rollout_batches"] == {"type": "integer", "description": "rollout batches per step (an example).",
                                        "minimum": 1, "maximum": 8}  # fmt: skip
    assert props["sampler"]["enum"] == ["a", "b"]


def test_provenance_fields_leave_the_fingerprint_and_only_they_do():
    base = C.config_fingerprint(_cfg().to_dict())
    changed = {
        "preset": "smol",
        "report_to": ["tensorboard"],
        "keep_checkpoints": 3,
        "fastgen": False,
        "save_every_minutes": 30.0,
    }
    assert set(changed) == set(C.fields_with(RunConfig, "provenance"))
    for name, value in changed.items():
        assert C.config_fingerprint(_cfg(**{name: value}).to_dict()) == base, name
    assert C.config_fingerprint(_cfg(threads=2).to_dict()) != base


def test_training_only_fields_leave_the_step0_key_and_only_they_do():
    from marlflow.training import base_eval

    d = _cfg().to_dict()
    kept = base_eval.inputs(_cfg())["config"]
    top = {n for n in d if n not in C.fields_with(RunConfig, "training_only")}
    assert set(kept) == top and "sharing" not in kept and "task_axis" in kept
    assert set(kept["grpo"]) == set(d["grpo"]) - set(C.fields_with(GRPOParams, "training_only"))
    assert set(kept["grpo"]) == {"top_p", "eval_temperature", "max_prompt_length", "max_completion_length"}


def test_run_section_schema_is_the_run_level_fields():
    run = M.schema()["$defs"]["run"]["properties"]
    nrl = set(C.fields_with(RunConfig, "not_run_level"))
    assert set(run) == {f.name for f in dataclasses.fields(RunConfig)} - nrl
    assert {"device", "threads", "ranks", "fastgen"} <= set(run) and "task_axis" not in run
    assert set(C.axis_fields(RunConfig).values()) <= nrl
    for name in ("device", "threads", "ranks"):  # run settings: matrix.yaml's `run:` is their one owner
        assert "A run setting" in C.help_of(RunConfig, name) and "A run setting" in run[name]["description"]


# ---------------------------------------------------------------------------------------------- axes


def test_axes_agree_with_the_lists_kept_elsewhere():
    """AXES is the one list of axes; the lists other floors keep (they cannot import pipeline) must agree."""
    from marlflow.analysis.seeds import CELL, REPLICATE
    from marlflow.store.schema import FACTOR_COLUMNS, INT_COLUMNS

    assert ["run_id", *M.AXES] == FACTOR_COLUMNS  # metrics columns: on disk, so checked, not derived
    assert C.axis_fields(RunConfig) == {a.name: a.field for a in M.AXES.values()}  # task -> task_axis
    assert list(_cfg().factors) == FACTOR_COLUMNS
    assert sorted([*CELL, *REPLICATE]) == sorted(M.AXES) and not set(CELL) & set(REPLICATE)
    assert set(M.INT_AXES) <= set(INT_COLUMNS)
    s = M.schema()["$defs"]
    assert list(s["axes"]["properties"]) == list(M.AXES) == list(s["when"]["properties"])
    assert set(M.config_keys()) >= {*M.AXES, *M.ALIASES}
    assert M.SHEET_COLUMNS[: len(M.AXES)] == list(M.AXES)
    assert s["workflow"]["enum"] and s["task_axis"]["enum"] == list(C.TASK_AXIS)


def test_run_id_names_every_axis():
    """Two cells that differ in one axis get two run ids (two run folders); run_sheet refuses a duplicate."""
    base = {"workflow": "voting", "sharing": "ip", "scale": "toy", "task": "math", "seed": 0, "build": 0,
            "intervention": "none"}  # fmt: skip
    other = {"workflow": "single", "sharing": "sp", "scale": "smol", "task": "code", "seed": 1, "build": 1,
             "intervention": "kl"}  # fmt: skip
    assert set(base) == set(M.AXES)
    for axis in M.AXES:
        assert M.run_id(**base) != M.run_id(**{**base, axis: other[axis]}), axis


def _copy_with_axis(monkeypatch, run_id: str = "named"):
    """marlflow.pipeline.matrix as it would be with one more axis, `lr_mult` (values x1, x2; default x1).
    What that takes, as edits to a copy of the module and a RunConfig subclass standing for core/config.py:
    1. core/config.py: a RunConfig field holding the value, its metadata naming the axis (here a subclass);
       omitted_at_default keeps every existing config.json, and so every run, as it is;
    2. pipeline/matrix.py: its Axis entry in AXES;
    3. pipeline/matrix.py: run_id gives it a part of the id, unless it is at its default (else two cells
       would share one run folder: run_sheet refuses that).
    Everything else in matrix.py (schema of axes / when / exclude, --config and its plural, defaults, the run
    sheet's column, the RunConfig keyword) follows from AXES. What does not, and what tests check instead:
    4. store/schema.py FACTOR_COLUMNS (the metrics' columns; RunConfig.factors raises without it), and
       read_metrics giving files written before the axis its default, as it does for `build`;
    5. analysis/seeds.py CELL or REPLICATE (test_axes_agree_with_the_lists_kept_elsewhere), and the analysis
       and report code that groups by hand-written column lists (analysis/plots.py PAIR_KEY, seeds.py's
       pair keys);
    6. matrix.yaml, where a preset lists the axis (optional: the default applies), and docs/reference.md."""

    @dataclass(frozen=True)
    class RunConfigX(RunConfig):
        lr_mult: str = field(default="x1", metadata={"help": "an example axis.", "axis": "lr_mult",
                                                     "enum": ("x1", "x2"), "omitted_at_default": True,
                                                     "not_run_level": True})  # fmt: skip

    host = type(sys)("example_axis_config")
    host.RunConfigX = RunConfigX
    monkeypatch.setitem(sys.modules, "example_axis_config", host)
    src = Path(M.__file__).read_text()
    edits = [  # (anchor, replacement): the edits of steps 1-3 above
        ("from marlflow.core.config import ConfigError, GRPOParams, RunConfig, TaskSpec\n",
         "from marlflow.core.config import ConfigError, GRPOParams, TaskSpec\n"
         "from example_axis_config import RunConfigX as RunConfig\n"),
        ('             "block; none = no intervention", "interventions", default=("none",)),\n',
         '             "block; none = no intervention", "interventions", default=("none",)),\n'
         '        Axis("lr_mult", "lr_mult", "a learning-rate multiplier", "lr_mults", default=("x1",)),\n'),
    ]  # fmt: skip
    for anchor, new in edits:
        assert src.count(anchor) == 1, anchor
        src = src.replace(anchor, new)
    part = {"named": "rid if lr_mult == 'x1' else f'{rid}-{lr_mult}'", "ignored": "rid"}.get(run_id)
    if part:  # step 3, or a run_id that takes the axis but leaves it out of the id
        src += "\n\n_run_id = run_id\n\n\ndef run_id(lr_mult='x1', **cell):\n"
        src += f"    rid = _run_id(**cell)\n    return {part}\n"
    spec = importlib.util.spec_from_loader("example_axis_matrix", loader=None)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "example_axis_matrix", mod)
    exec(compile(src, M.__file__, "exec"), mod.__dict__)
    return mod, RunConfigX


def test_a_new_axis(monkeypatch):
    """An axis added in AXES (and its RunConfig field, and its part of the run id) is a matrix axis
    everywhere in the matrix: schema, defaults, --config, `when:`, the run sheet and the run configs."""
    mod, run_config = _copy_with_axis(monkeypatch)
    doc = yaml.safe_load(MATRIX.read_text())
    for preset in doc["presets"]:  # every preset leaves the axis out: the default, the same runs as before
        assert mod.run_sheet(doc, preset).drop(columns="lr_mult").equals(M.run_sheet(doc, preset)), preset

    doc["presets"]["lr"] = lr = {"extends": "toy", "axes": {"workflow": ["voting"], "sharing": ["ip"],
                                 "task": ["math"], "lr_mult": ["x1", "x2"]},
                                 "overrides": [{"when": {"lr_mult": "x2"}, "grpo": {"learning_rate": 4.0e-3}}]}  # fmt: skip
    sheet = mod.run_sheet(doc, "lr")
    assert list(sheet.index) == ["voting-ip-toy-math-s0", "voting-ip-toy-math-s0-x2"]
    assert list(sheet["lr_mult"]) == ["x1", "x2"] and "lr_mult" in mod.SHEET_COLUMNS
    cfg = run_config.from_dict(json.loads(sheet.loc["voting-ip-toy-math-s0-x2", "config"]))
    assert cfg.lr_mult == "x2" and cfg.grpo.learning_rate == 4.0e-3
    assert "lr_mult" not in json.loads(sheet.loc["voting-ip-toy-math-s0", "config"])  # existing configs kept
    assert list(mod.run_sheet(doc, "lr", {"lr_mults": ["x2"]}).index) == ["voting-ip-toy-math-s0-x2"]
    mod.check_config_keys({"matrix": "m", "lr_mults": "x2"})
    with pytest.raises(
        mod.MatrixError, match=r"presets\.lr\.axes\.lr_mult\[1\] is 'x3'.*Allowed values: x1, x2"
    ):
        lr["axes"]["lr_mult"] = ["x1", "x3"]
        mod.run_sheet(doc, "lr")
    with pytest.raises(KeyError, match="'lr_mult' has no column in marlflow.store.schema.FACTOR_COLUMNS"):
        _ = cfg.factors  # step 4: the metrics need the column


@pytest.mark.parametrize(
    ("run_id", "error", "message"),
    [("absent", TypeError, "unexpected keyword argument 'lr_mult'"),
     ("ignored", "MatrixError", "presets.lr: expands to run 'voting-ip-toy-math-s0' more than once")],
)  # fmt: skip
def test_a_new_axis_needs_its_part_of_the_run_id(monkeypatch, run_id, error, message):
    """Step 3 is not optional: without it two cells would train into one run folder."""
    mod, _ = _copy_with_axis(monkeypatch, run_id)
    doc = yaml.safe_load(MATRIX.read_text())
    doc["presets"]["lr"] = {"extends": "toy", "axes": {"workflow": ["voting"], "sharing": ["ip"],
                            "task": ["math"], "lr_mult": ["x1", "x2"]}}  # fmt: skip
    with pytest.raises(getattr(mod, error) if isinstance(error, str) else error, match=re.escape(message)):
        mod.run_sheet(doc, "lr")


# ---------------------------------------------------------------------------------------- task kind


def test_task_axis_must_be_the_registered_tasks_kind():
    from marlflow.tasks import get_task

    cfg = _cfg()
    C.check_task_kind(cfg, get_task("toy_math").kind)
    code = dataclasses.replace(cfg, task=TaskSpec(name="toy_code"))
    with pytest.raises(ConfigError, match="task_axis is 'math' but task.name 'toy_code' is a code task"):
        C.check_task_kind(code, get_task("toy_code").kind)


def test_matrix_refuses_a_task_listed_under_the_other_kind():
    doc = yaml.safe_load(MATRIX.read_text())
    doc["presets"]["toy"]["tasks"]["code"]["name"] = "toy_math"
    with pytest.raises(M.MatrixError) as exc:
        M.run_sheet(doc, "toy")
    msg = str(exc.value)
    for part in ("presets.toy.tasks.code.name", "'toy_math' is a math task", "'code' task", "toy_code"):
        assert part in msg, (part, msg)


def test_train_cli_refuses_a_config_whose_task_axis_is_not_its_tasks_kind(
    tmp_path, capsys, preempt_installed
):
    from marlflow.cli import train

    cfg = dataclasses.replace(_cfg(), task_axis="code").to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert train.main(["--config", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert (
        "invalid run config" in err and "task_axis is 'code' but task.name 'toy_math' is a math task" in err
    )
    assert not (tmp_path / "run").exists()
