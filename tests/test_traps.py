"""The user path's silent traps, one test each: what used to be accepted quietly now fails
loudly (or is done right), with a message that names the fix.

The eval budget traps are in tests/test_cli.py (they reuse its trained run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


# ---------------------------------------------------------------- adapters load from any directory


def test_adapters_name_their_base_by_its_absolute_folder_and_load_from_anywhere(
    toy_model_dir, tmp_path, monkeypatch
):
    """A 1-step run trained in clone A (base: results/models/toy): final/'s adapters name the base's absolute
    folder, chosen when final/ was written, so PEFT loads them from any working directory (before: the path
    relative to the repository root, which loaded from that root only), and the model cards are valid metadata
    (`base_model:` holds hub ids only; before: a path). Copied to clone B with A deleted, marlflow's own loader
    (eval, chat) still finds B's base, through the run's config.json and the root that holds the run."""
    from huggingface_hub import ModelCard
    from peft import AutoPeftModelForCausalLM

    from marlflow.cli.train import run
    from marlflow.core.config import GRPOParams, RunConfig, TaskSpec
    from marlflow.models.runs import find_checkpoint, load_policy_model, resolve_model
    from marlflow.training.final import model_card

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
    base = (clone_a / "results" / "models" / "toy").resolve()
    final = clone_a / rel_run / "final" / "shared"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the root that holds results/
    model = AutoPeftModelForCausalLM.from_pretrained(str(final))
    assert Path(model.base_model.model.config._name_or_path) == base
    for card in (final.parent / "README.md", final / "README.md"):
        data = ModelCard(card.read_text()).data.to_dict()
        assert "base_model" not in data and data["library_name"] == "peft", data
        assert f"| base model | `{base}` |" in card.read_text()
    hub = ModelCard(model_card(cfg, "Qwen/Qwen3-0.6B", 1, None)).data.to_dict()
    assert hub["base_model"] == "Qwen/Qwen3-0.6B"
    shutil.copytree(clone_a, clone_b)
    shutil.rmtree(clone_a)
    run_b = clone_b / rel_run
    assert resolve_model(cfg, run_b) == str(clone_b / "results" / "models" / "toy")
    load_policy_model(cfg, run_b, find_checkpoint(run_b)[1])  # the checkpoint's adapters on B's base


# ---------------------------------------------------------------- config keys and the SLURM account


def marlflow(*args, cwd=ROOT):
    """The `marlflow` console script (or its main() through `python -m` when it is not installed)."""
    exe = [str(BIN / "marlflow")] if (BIN / "marlflow").exists() else [sys.executable, "-m", "marlflow"]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([*exe, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def _snakemake(*args, cwd=ROOT, env=None):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})}
    return subprocess.run([str(BIN / "snakemake"), *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "key,hint",
    [
        ("wrkflows=[voting]", "Did you mean 'workflows'?"),
        ("learning_rate=0.001", "presets.<preset>.grpo.learning_rate"),
    ],
)
def test_unknown_config_key_fails_with_a_did_you_mean(key, hint):
    """Before: Snakemake ignored both keys and ran (or planned) the whole default matrix."""
    out = _snakemake("-n", "--profile", "profiles/local", "--config", key)
    assert out.returncode == 2, out.stdout[-1500:]
    assert f"error: --config: {key.split('=')[0]!r} is not a config key" in out.stderr, out.stderr
    assert hint in out.stderr and "Known keys: matrix, preset" in out.stderr and "Traceback" not in out.stderr


def test_known_config_keys_pass():
    from marlflow.pipeline.matrix import check_config_keys

    check_config_keys({"matrix": "matrix.yaml", "preset": "smol", "workflows": ["voting"], "seed": 1,
                       "scale_resources": {}, "toy_build": "--build"})  # fmt: skip


@pytest.mark.slow
def test_a_target_after_config_is_a_target():
    """`marlflow run -n --config preset=smoke TARGET`: Snakemake's --config swallowed the target and raised a
    traceback ("Config entries have to be defined as name=value pairs")."""
    target = "results/runs/single-sp-toy-math-s0-smoke/config.json"
    # -f: plan the target's job even where an earlier run (the SLURM smoke, `make run`) left it up to date
    out = marlflow("run", "-n", "-f", "--config", "preset=smoke", target)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "run_config" in out.stdout and "rule train" not in out.stdout  # only the target's job


@pytest.mark.slow
def test_slurm_account_placeholder_is_refused_before_any_job(tmp_path):
    """A copy of the repository with sbatch on PATH that records every call: the shipped profile (slurm_account:
    CHANGE_ME) exits 2 with where to set it, and sbatch is never called. Before: jobs were submitted and each
    failed in sbatch."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for item in ("Snakefile", "matrix.yaml", "rules", "profiles"):
        (shutil.copytree if (ROOT / item).is_dir() else shutil.copy2)(ROOT / item, repo / item)
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "sbatch-calls"
    for tool in ("sbatch", "squeue", "sacct", "sinfo", "sacctmgr", "scontrol"):  # only sbatch submits
        (fake / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}.{tool}\nexit 1\n')
        (fake / tool).chmod(0o755)
    calls = Path(f"{calls}.sbatch")
    env = {"PATH": f"{fake}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}"}
    for dry in (["-n"], []):
        out = _snakemake(*dry, "--profile", "profiles/slurm", cwd=repo, env=env)
        assert out.returncode == 2, out.stdout[-1500:] + out.stderr[-1500:]
        err = out.stderr
        assert "resource slurm_account is CHANGE_ME" in err and "profiles/slurm/config.yaml" in err, err
        assert "slurm-no-account: true" in err and "Traceback" not in err
        assert not calls.exists(), calls.read_text()


# ---------------------------------------------------------------- each attempt keeps its log


@pytest.mark.slow
def test_a_retried_train_job_keeps_each_attempts_log(tmp_path):
    """Attempts of the train rule's command on one log path, where an attempt-1 log is already kept: the newest
    is LOG, the earlier one LOG.attempt-2, each with its own output. Before: `> {log}` truncated the killed
    attempt's log."""
    log = tmp_path / "logs" / "train" / "run.log"
    log.parent.mkdir(parents=True)
    log.with_name("run.log.attempt-1").write_text("the first attempt\n")
    for attempt in range(2):
        bad = tmp_path / f"config{attempt}.json"
        bad.write_text(f'{{"attempt": {attempt}}}')  # an invalid run config: exits 2 right after logging
        out = subprocess.run(
            [sys.executable, "-m", "marlflow.cli.train", "--config", str(bad), "--out", str(tmp_path / "run"),
             "--log", str(log)], capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 2 and out.stderr == "", out.stderr
    text = log.read_text()
    assert "config1.json" in text and "config0.json" not in text and "run.log.attempt-2" in text
    assert "config0.json" in log.with_name("run.log.attempt-2").read_text()
    assert log.with_name("run.log.attempt-1").read_text() == "the first attempt\n"
    assert not log.with_name("run.log.attempt-3").exists()
    shell = (ROOT / "rules" / "train.smk").read_text().split("rule train:")[1].split("shell:")[1]
    assert "--log {log:q}" in shell and "> {log}" not in shell


# ---------------------------------------------------------------- a slice or a preset has its own tables


def test_output_folders_per_preset_and_slice():
    from marlflow.pipeline.matrix import output_dir

    assert output_dir("matrix.yaml") == "results"  # the default preset in full: the README's paths
    assert output_dir("matrix.yaml", "toy2", {"seeds": [0], "tasks": ["code", "math"]}) == "results"  # no cut
    assert output_dir("matrix.yaml", "toy") == "results/presets/toy"  # v1: a named preset, not the default
    assert output_dir("matrix.yaml", "smoke") == "results/presets/smoke"
    assert output_dir("matrix.yaml", "smol", {"workflows": ["voting"], "tasks": ["math"]}) == (
        "results/presets/smol/slice-workflow-voting,task-math"
    )
    assert output_dir("matrix.yaml", None, {"sharing": "sp"}) == "results/slice-sharing-sp"


@pytest.mark.slow
def test_a_slice_writes_its_tables_and_report_under_its_own_folder():
    """Before: `--config workflows=[voting]` planned results/tables/* and results/report.html, overwriting the
    full matrix's tables and report with the slice's."""
    out = _snakemake("-n", "--forceall", "--profile", "profiles/local", "--config", "workflows=[voting]")
    assert out.returncode == 0, out.stderr[-2000:]
    outputs = [p for line in out.stdout.splitlines() if line.strip().startswith(("output:", "log:"))
               for p in line.split(":", 1)[1].replace(",", " ").split() if not p.startswith("(")]  # fmt: skip
    # (a flag Snakemake prints after a path, such as "(update)" on the train rule's outputs, is no path)
    mine = "results/slice-workflow-voting/"
    for name in ("tables/summary.csv", "report.html", "figures/curves.png", "logs/aggregate.log"):
        assert mine + name in outputs, name
    shared = [
        p for p in outputs if not p.startswith((mine, "results/runs/", "results/models/", "results/logs/"))
    ]
    assert not shared, shared


# ---------------------------------------------------------------- help and messages


def test_marlflow_run_help_is_its_own():
    """Before: Snakemake's whole help (hundreds of lines) under the name __main__.py."""
    out = marlflow("run", "--help", cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("usage: marlflow run "), out.stdout[:300]
    assert "__main__.py" not in out.stdout + out.stderr and len(out.stdout.splitlines()) < 40
    assert "--config" in out.stdout and "preset=NAME" in out.stdout and "snakemake --help" in out.stdout


@pytest.mark.parametrize(
    "command", ["matrix", "models", "train", "eval", "chat", "aggregate", "report", "plan"]
)
def test_every_command_has_its_help_and_errors_under_the_name_users_type(command, capsys):
    from marlflow.cli import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: marlflow {command} ")
    with pytest.raises(SystemExit) as bad:  # `python -m marlflow.<module> --bogus` is the same main()
        main([command, "--no-such-option"])
    err = capsys.readouterr().err
    assert bad.value.code == 2 and f"usage: marlflow {command} " in err and "python -m" not in err, err


def test_sandbox_help_names_marlflow_sandbox():
    """The sandbox keeps its one-JSON-line error contract, but its help names the command users type."""
    out = subprocess.run(
        [sys.executable, "-m", "marlflow", "sandbox", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.startswith("usage: marlflow sandbox "), out.stdout[:200]


def test_python_dash_m_marlflow_is_the_command():
    out = subprocess.run(
        [sys.executable, "-m", "marlflow", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.startswith("usage: marlflow ")


def test_missing_model_message_is_filled_in(tmp_path, monkeypatch):
    from marlflow.models.loading import resolve_model_source

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_source("results/models/toy")
    msg = str(err.value)
    assert "`marlflow models prepare --scale toy --model results/models/toy --out results/models/toy`" in msg
    assert "<scale>" not in msg and "<model>" not in msg


def test_missing_base_model_names_each_folder_once(tmp_path, monkeypatch):
    """Run from the root that holds the run: "relative to /tmp/nc or to /tmp/nc" named one folder twice."""
    from marlflow.core.config import RunConfig, TaskSpec
    from marlflow.models.runs import RunError, resolve_model

    cfg = RunConfig(run_id="single-sp-toy-math-s0", workflow="single", sharing="sp", scale="toy",
                    task_axis="math", seed=0, task=TaskSpec(name="toy_math"), model="results/models/toy")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunError) as err:
        resolve_model(cfg, tmp_path / "results" / "runs" / cfg.run_id)
    msg = str(err.value)
    assert f"(relative to {tmp_path})" in msg and " or to " not in msg, msg


def test_an_error_names_the_preset_where_the_bad_value_is_written():
    """group_size 1 written in `toy`, expanded through toy_seeds (extends toy): before, the error said
    presets.toy_seeds and told the user to fix presets.toy_seeds.grpo, where nothing is wrong."""
    import yaml

    from marlflow.pipeline.matrix import MatrixError, run_sheet

    doc = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    doc["presets"]["toy"]["grpo"]["group_size"] = 1
    with pytest.raises(MatrixError) as err:
        run_sheet(doc, "toy_seeds")
    msg = str(err.value)
    assert msg.startswith("matrix: presets.toy (run ") and "inherited by presets.toy_seeds" in msg, msg
    assert "Fix it in presets.toy.grpo" in msg and "presets.toy_seeds.grpo" not in msg


def test_matrix_from_another_folder_says_which_file_and_where_it_looked(tmp_path):
    out = marlflow("matrix", cwd=tmp_path)
    assert out.returncode == 2 and f"{tmp_path / 'matrix.yaml'} does not exist" in out.stderr, out.stderr
    assert (
        "looked up in the current folder" in out.stderr and "marlflow matrix PATH/matrix.yaml" in out.stderr
    )
