"""Snakemake plans (dry runs only), lint, and matrix errors surfacing through Snakemake."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SNAKEMAKE = BIN / "snakemake"

pytestmark = pytest.mark.skipif(
    not SNAKEMAKE.exists(), reason="snakemake is not installed in this environment"
)


def snakemake(*args, check=True):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(
        [str(SNAKEMAKE), *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300
    )
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def job_counts(text):
    """{rule: count} from the first 'Job stats' table of a dry run."""
    table = text.split("Job stats:")[1].split("total")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}


@pytest.mark.slow
def test_local_default_plans_toy2():
    # --forceall: the plan must not depend on what an earlier run left in results/
    out = snakemake("-n", "--forceall", "--profile", "profiles/local")
    # the default preset is toy world v2 (matrix.yaml's default_preset: toy2): its model and run ids
    assert "results/models/toy2" in out.stdout and "voting-sp-toy2-math-s0" in out.stdout, out.stdout[-3000:]
    assert job_counts(out.stdout) == {
        "models": 1,
        "run_config": 14,
        "train": 14,
        "aggregate": 1,
        "report": 1,
        "all": 1,
    }


@pytest.mark.slow
def test_local_paper_plans_42():
    out = snakemake("-n", "--forceall", "--profile", "profiles/local", "--config", "preset=paper")
    counts = job_counts(out.stdout)
    assert counts["train"] == 42 and counts["models"] == 3


@pytest.mark.slow
def test_toy_builds_get_their_own_model_folder_and_seed():
    # toy_seeds' build 1 trains from results/models/toy-b1, prepared with --seed 1; build 0 from the shipped model
    out = snakemake("-n", "--forceall", "-p", "--profile", "profiles/local", "--config", "preset=toy_seeds")
    counts = job_counts(out.stdout)
    assert counts["train"] == 84 and counts["models"] == 2, counts
    assert re.search(r"--out results/models/toy-b1\s+--seed 1\b", out.stdout), out.stdout[-3000:]
    assert "input: results/runs/voting-ip-toy-math-s2-b1/config.json, results/models/toy-b1" in out.stdout
    clash = snakemake("-n", "--profile", "profiles/local", "--config", "preset=toy_seeds", "toy_build=--seed 3",
                      check=False)  # fmt: skip
    assert clash.returncode == 2 and "drop --seed from toy_build" in clash.stderr, clash.stderr[-1500:]


@pytest.mark.slow
def test_config_restricts_axes():
    out = snakemake(
        "-n", "--profile", "profiles/local", "--config", "preset=smol", "workflows=[voting]", "tasks=[math]"
    )
    assert job_counts(out.stdout)["train"] == 2


@pytest.mark.slow
def test_slurm_profile_plans_paper_with_gpus_per_scale(tmp_path):
    # the shipped profile's slurm_account is CHANGE_ME, which is refused (tests/test_traps.py): a user's copy
    profile = tmp_path / "slurm"
    shutil.copytree(ROOT / "profiles" / "slurm", profile)
    conf = profile / "config.yaml"
    conf.write_text(conf.read_text().replace("slurm_account: CHANGE_ME", "slurm_account: myacct"))
    out = snakemake("-n", "--profile", str(profile))
    assert job_counts(out.stdout)["train"] == 42
    train_jobs = [b for b in out.stdout.split("rule ")[1:] if b.startswith("train:")]
    assert len(train_jobs) == 42
    res = {}
    for block in train_jobs:
        scale = re.search(r"run_id=[a-z_]+-(?:sp|ip)-([0-9.]+b)-", block)[1]
        res.setdefault(scale, set()).add(re.search(r"resources: (.*)", block)[1])
    assert set(res) == {"0.6b", "1.7b", "4b"}
    for scale, lines in res.items():
        (line,) = lines  # the same resources for every run of a scale
        assert "gpu=1" in line and "slurm_partition=" in line, (scale, line)
    assert "mem_mb=64000" in next(iter(res["0.6b"])) and "mem_mb=128000" in next(iter(res["4b"]))


def test_lint_clean():
    out = snakemake("--lint")
    assert "Congratulations" in out.stdout + out.stderr and "Lints for" not in out.stdout + out.stderr


@pytest.mark.slow
def test_invalid_matrix_same_message_as_cli(tmp_path):
    bad = tmp_path / "matrix.yaml"
    bad.write_text((ROOT / "matrix.yaml").read_text().replace("group_size: 8", "group_size: 1", 1))
    cli = subprocess.run(
        [sys.executable, "-m", "marlflow", "matrix", str(bad)], capture_output=True, text=True
    )
    out = snakemake("-n", "--profile", "profiles/local", "--config", f"matrix={bad}", check=False)
    assert cli.returncode == 2 and out.returncode == 2
    assert "group_size" in cli.stderr and cli.stderr.strip() in out.stderr
    assert "Traceback" not in out.stderr
