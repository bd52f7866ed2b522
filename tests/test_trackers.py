"""Experiment trackers (RunConfig.report_to, marlflow.training.trackers): a real toy run's tracker files read back.

TensorBoard's event file holds every row of metrics.parquet as the scalar `{split}/{role}/{metric}` at its
step, with the same value, plus the run id and config; a run resumed from an earlier checkpoint leaves each
step once, and a tracker turned on after the run finished is filled in from the checkpoint. trackio and wandb are checked where their libraries are installed (not by `make test`: see the
`trackers` extra in pyproject.toml). Unknown tracker names and missing libraries are refused with a message
that says what to do.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from marlflow.core.config import ConfigError, RunConfig, TaskSpec
from marlflow.training.trackers import run_config, tag

ROOT = Path(__file__).resolve().parents[1]


def _parquet(run_dir: Path) -> dict[tuple[str, int], float]:
    m = pd.read_parquet(run_dir / "metrics.parquet")
    return {(tag(r), int(r["step"])): float(r["value"]) for r in m.to_dict("records")}


def _same(a: float, b: float) -> bool:
    """TensorBoard stores float32: equal at float32 precision (NaN equals NaN)."""
    return bool(np.float32(a) == np.float32(b) or (np.isnan(a) and np.isnan(b)))


def _tensorboard_mirrors(run_dir: Path, steps: set[int]):
    """Assert that the run's event files hold every row of metrics.parquet, once, with its value, and nothing
    else; `steps` are the steps metrics.parquet has. Returns the EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(
        str(run_dir / "trackers" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}
    )
    ea.Reload()
    events = [(t, e.step, e.value) for t in ea.Tags()["scalars"] for e in ea.Scalars(t)]
    got, want = {(t, s): v for t, s, v in events}, _parquet(run_dir)
    assert len(got) == len(events), "a step logged twice"
    assert set(got) == set(want) and {s for _, s in want} == steps
    bad = {k: (got[k], want[k]) for k in want if not _same(got[k], want[k])}
    assert not bad, bad
    return ea


@pytest.mark.slow
def test_tensorboard_mirrors_metrics_through_resume_and_backfill(make_cfg, tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    from marlflow.cli.train import run

    cfg = dataclasses.replace(make_cfg("voting", "ip", steps=2), report_to=["tensorboard"])
    out = tmp_path / "run"
    run(cfg, out)
    ea = _tensorboard_mirrors(out, {0, 1, 2})
    tags = set(ea.Tags()["scalars"])
    assert {"train/generator/reward_mean", "train/aggregator/grad_norm", "eval/all/accuracy"} <= tags
    # run name and config: a JSON text summary, and an HParams session
    text = ea.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
    doc = json.loads(text.strip("`\n"))
    assert doc == {"run_name": cfg.run_id, "config": run_config(cfg)}
    assert doc["config"]["workflow"] == "voting" and doc["config"]["grpo.learning_rate"] == 1e-2
    hp = plugin_data_pb2.HParamsPluginData.FromString(
        ea.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    ).session_start_info.hparams
    assert hp["run_id"].string_value == cfg.run_id and hp["grpo.steps"].number_value == 2

    # Resume from step 1 (as if killed after logging step 2 but before its checkpoint) and train to step 3:
    # step 2 is recomputed and logged again (its timings differ), and TensorBoard hides the first job's.
    shutil.rmtree(out / "checkpoints" / "step-2")
    longer = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, steps=3))
    run(longer, out)
    _tensorboard_mirrors(out, {0, 1, 2, 3})

    # A tracker that never logged the run (turned on after it finished): the rerun trains nothing and
    # fills it in with every step of the checkpoint.
    shutil.rmtree(out / "trackers")
    run(longer, out)
    _tensorboard_mirrors(out, {0, 1, 2, 3})
    assert json.loads((out / "trackers" / "logged.json").read_text()) == {"tensorboard": 3}


# trackio's store location is read when trackio is imported (TRL imports it): read it in a fresh process.
READ_TRACKIO = """import json, sys
from trackio.sqlite_storage import SQLiteStorage as S
print(json.dumps([S.get_logs("marlflow", sys.argv[1]), S.get_run_config("marlflow", sys.argv[1])]))"""


@pytest.mark.parametrize("name", ["trackio", "wandb"])
def test_local_store_round_trip(make_cfg, tmp_path, name):
    """`python -m marlflow train` with report_to [trackio] or [wandb] and no tracker variables set: the run's
    metrics land in RUN/trackers/<name>/, offline."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed (pip install {name}); `make test` installs only tensorboard")
    cfg = dataclasses.replace(make_cfg("single", "sp", steps=2), report_to=[name])
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKIO_", "WANDB_"))}
    cmd = [
        sys.executable,
        "-m",
        "marlflow.cli.train",
        "--config",
        str(tmp_path / "config.json"),
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    want = _parquet(out)
    if name == "trackio":
        env["TRACKIO_DIR"] = str(out / "trackers" / "trackio")
        p = subprocess.run(
            [sys.executable, "-c", READ_TRACKIO, cfg.run_id], env=env, capture_output=True, text=True
        )
        assert p.returncode == 0, p.stderr[-3000:]
        logs, config = json.loads(p.stdout.splitlines()[-1])
        got = {(k, r["step"]): v for r in logs for k, v in r.items() if k not in ("step", "timestamp")}
        assert got == pytest.approx(want, nan_ok=True)
        assert {k: config[k] for k in run_config(cfg)} == run_config(cfg)
    else:  # wandb: an offline run (no WANDB_MODE, no WANDB_API_KEY), named after the run id
        (record,) = (out / "trackers" / "wandb").glob("wandb/offline-run-*/run-*.wandb")
        data = record.read_bytes()
        wandb_id = (out / "trackers" / "wandb" / "wandb-id").read_text().strip()
        assert record.name == f"run-{wandb_id}.wandb"
        missing = [t for t, _ in want if t.encode() not in data]
        assert not missing and cfg.run_id.encode() in data and b"grpo.learning_rate" in data, missing


def _cfg(**kw) -> RunConfig:
    return RunConfig(run_id="x", workflow="single", sharing="sp", scale="toy", task_axis="math", seed=0,
                     task=TaskSpec(name="toy_math"), model="m", **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["tensorbord"], "report_to lists 'tensorbord', which is not one of: tensorboard, trackio, wandb"),
        ("wandb", "report_to is 'wandb' of type str, but it must be a list of values from: tensorboard, "),
        (["wandb", "wandb"], "report_to lists a value more than once"),
    ],
)
def test_unknown_tracker_is_refused(value, message):
    with pytest.raises(ConfigError) as err:
        _cfg(report_to=value)
    assert message in str(err.value)
    with pytest.raises(ConfigError) as err:  # a hand-edited config.json too
        RunConfig.from_dict({**_cfg().to_dict(), "report_to": value})
    assert message in str(err.value)


def test_report_to_in_matrix_yaml():
    from marlflow.pipeline.matrix import MatrixError, run_sheet

    doc = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    bad = copy.deepcopy(doc)
    bad["presets"]["toy"]["run"]["report_to"] = ["tensorbord"]
    with pytest.raises(MatrixError, match=r"presets\.toy\.run\.report_to\[0\] is 'tensorbord'.*Did you mean "
                       r"'tensorboard'\?.*Allowed values: tensorboard, trackio, wandb"):  # fmt: skip
        run_sheet(bad, "toy")
    doc["presets"]["toy"]["run"]["report_to"] = ["tensorboard", "wandb"]
    cfg = RunConfig.from_dict(json.loads(run_sheet(doc, "toy")["config"].iloc[0]))
    assert cfg.report_to == ["tensorboard", "wandb"]
    # No trackers: the run config is what it was before report_to existed (Snakemake reruns nothing).
    assert "report_to" not in json.loads(run_sheet(ROOT / "matrix.yaml", "toy")["config"].iloc[0])


def test_missing_library_names_the_extra(monkeypatch):
    import marlflow.training.trackers as trackers
    from marlflow.cli.train import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(RuntimeError, match=r"report_to asks for wandb, but wandb is not installed: pip install "
                       r"-c constraints-cpu.txt -e '\.\[trackers\]'"):  # fmt: skip
        preflight(_cfg(report_to=["tensorboard", "wandb"]))
    with pytest.raises(RuntimeError, match="wandb is not installed"):  # the trainer's own check
        trackers.Trackers(_cfg(report_to=["wandb"]), "unused")
    preflight(_cfg(report_to=["tensorboard"]))
