"""Toy world v2's scales `toy2s` and `toy2` (marlflow.core.config.TOY_SCALES) are toy-like wherever `toy` is:
the config takes a build b > 0 for them, the run sheet and the Snakemake helpers give them their own model
folders (results/models/<scale>[-b<b>]), the planner knows their shapes before they are built, and the
analysis and report treat them as designed toy environments. Fast: no model is built or loaded."""

import copy
import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from marlflow.core.config import SCALES, TOY_SCALES, ConfigError, RunConfig, TaskSpec
from marlflow.models import toybuild2
from marlflow.pipeline.matrix import MatrixError, run_sheet

ROOT = Path(__file__).resolve().parents[1]
DOC = yaml.safe_load((ROOT / "matrix.yaml").read_text())
NEW = ("toy2s", "toy2")


def _cfg(scale, build=0):
    return RunConfig(run_id="r", workflow="voting", sharing="sp", scale=scale, task_axis="math", seed=0,
                     task=TaskSpec(name="toy_math"), model="m", build=build)  # fmt: skip


def _doc(scales, builds=(0,)):
    """matrix.yaml with its toy preset moved to `scales` (each at results/models/<scale>) and `builds`."""
    d = copy.deepcopy(DOC)
    p = d["presets"]["toy"]
    p["axes"].update(scale=list(scales), build=list(builds))
    p["models"] = {s: f"results/models/{s}" for s in scales}
    return d


def test_scales_and_toy_scales():
    assert SCALES == ("toy", "toy2s", "toy2", "smol", "0.6b", "1.7b", "4b")
    assert TOY_SCALES == ("toy", "toy2s", "toy2") and set(TOY_SCALES) <= set(SCALES)


@pytest.mark.parametrize("scale", NEW)
def test_config_takes_the_new_scales_and_their_builds(scale):
    assert _cfg(scale).scale == scale
    cfg = _cfg(scale, build=1)
    assert cfg.build == 1 and cfg.factors["build"] == 1
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_config_refuses_a_build_of_a_fixed_model():
    with pytest.raises(ConfigError, match="toy models only") as err:
        _cfg("smol", build=1)
    assert all(s in str(err.value) for s in TOY_SCALES)


def test_run_sheet_of_toy2_gives_run_ids_and_model_folders():
    from marlflow.pipeline.snake import model_folders, model_refusal, toy_seed_refusal

    sheet = run_sheet(_doc(["toy", *NEW], builds=[0, 1]), "toy", {"workflow": ["voting"], "task": ["math"]})
    assert sorted(sheet.index) == sorted(
        f"voting-{sh}-{sc}-math-s0{'-b1' if b else ''}"
        for sh in ("sp", "ip")
        for sc in ("toy", *NEW)
        for b in (0, 1)
    )
    row = sheet.loc["voting-ip-toy2-math-s0-b1"]
    assert (row["scale"], row["build"], row["model"]) == ("toy2", 1, "results/models/toy2-b1")
    assert json.loads(row["config"])["model"] == "results/models/toy2-b1"
    assert sheet.loc["voting-sp-toy2s-math-s0", "model"] == "results/models/toy2s"
    # toy's ids and folders are what they were before the new scales
    assert sheet.loc["voting-ip-toy-math-s0", "model"] == "results/models/toy"
    assert sheet.loc["voting-ip-toy-math-s0-b1", "model"] == "results/models/toy-b1"
    folders = model_folders(sheet)
    assert folders == {
        f"{sc}-b{b}" if b else sc: {
            "scale": sc,
            "build": b,
            "model": f"results/models/{sc}{f'-b{b}' if b else ''}",
        }
        for sc in ("toy", *NEW)
        for b in (0, 1)
    }
    assert model_refusal(sheet) is None  # the models rule prepares every one of them
    assert "drop --seed from toy_build" in toy_seed_refusal({"toy_build": "--seed 3"}, sheet)


def test_a_toy2_model_elsewhere_is_refused_with_its_prepared_folder():
    from marlflow.pipeline.snake import model_refusal

    d = _doc(["toy2"])
    d["presets"]["toy"]["models"]["toy2"] = "results/models/no-such-toy2"
    msg = model_refusal(run_sheet(d, "toy", {"workflow": ["single"]}))
    assert msg and "prepares scale toy2's model in results/models/toy2" in msg


def test_run_sheet_refuses_builds_of_fixed_scales_only():
    d = copy.deepcopy(DOC)
    d["presets"]["smol"]["axes"].update(build=[0, 1])
    with pytest.raises(MatrixError, match="toy models"):
        run_sheet(d, "smol")


def test_plan_knows_both_shapes_before_they_are_built(tmp_path):
    from marlflow.pipeline import plan

    small, big = (plan.model_shape(str(tmp_path / s), s) for s in NEW)  # no folder yet: the fallback shapes
    assert (small.hidden, small.layers, small.intermediate, small.heads, small.kv_heads, small.head_dim) == (
        96, 4, 288, 3, 1, 32,
    )  # fmt: skip
    assert (big.hidden, big.layers, big.intermediate, big.heads, big.kv_heads, big.head_dim) == (
        128,
        4,
        384,
        4,
        2,
        32,
    )
    for s in (small, big):
        assert s.tied and s.qk_norm and s.vocab <= 768
    toy = plan.FALLBACK_SHAPES["toy"]
    assert big.params == toy.params and small.params < big.params


def test_analysis_and_report_treat_them_as_toy():
    from marlflow.analysis.claims import DESIGNED
    from marlflow.analysis.tables import SCALE_ORDER
    from marlflow.core.definitions import TOY_BASE_BAND
    from marlflow.report.findings import band_warning

    assert SCALE_ORDER[:4] == ["toy", "toy2s", "toy2", "smol"]
    assert set(TOY_SCALES) | {"smol"} == set(DESIGNED)
    lo, hi = TOY_BASE_BAND
    summary = pd.DataFrame({
        "run_id": ["a-toy", "b-toy2", "c-toy2s", "d-smol"],
        "scale": ["toy", "toy2", "toy2s", "smol"],
        "base": [(lo + hi) / 2, lo / 2, (lo + hi) / 2, 0.0],
    })  # fmt: skip
    warn = band_warning(summary)
    assert warn and warn.startswith("1 of 3 toy bases") and "b-toy2" in warn and "d-smol" not in warn


def test_provenance_lists_toy2_models(tmp_path):
    from marlflow.report.provenance import toy_model_provenance

    folder = tmp_path / "toy2"
    folder.mkdir()
    (folder / "warmstart.json").write_text(
        json.dumps({"weights_sha256": "ab" * 32, "torch": "2.x", "threads": 2})
    )
    info = {
        "r": {"config": {"scale": "toy2", "model": str(folder)}},
        "s": {"config": {"scale": "smol", "model": "x"}},
    }
    ((label, text),) = toy_model_provenance(info)
    shipped = json.loads((toybuild2.SHIPPED["toy2"] / "warmstart.json").read_text())["weights_sha256"]
    assert label == f"toy2 model {folder}" and text.startswith(
        f"weights_sha256 {'ab' * 32}, not the shipped model ({shipped[:16]}...): rebuilt"
    )
    # a folder with the shipped toy2 weights is named as the toy2 model marlflow ships (each scale its own)
    (folder / "warmstart.json").write_text(json.dumps({"weights_sha256": shipped, "threads": 2}))
    ((_, text),) = toy_model_provenance(info)
    assert text.startswith(f"weights_sha256 {shipped}, the model marlflow ships; built on")
