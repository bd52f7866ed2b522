"""The newcomer's path, round 3 (issue 41): one test per item, each through the real commands (`snakemake`,
`marlflow`), each failing on the behaviour the issue reports.

1. Resume notices what is missing: a run folder deleted, moved away, or left unfinished by a killed retrain is
   retrained by the same `snakemake`, and the tables are rebuilt (before: "Nothing to be done").
2. A model path that no job could load is refused before anything runs, and a retrain that fails before training
   leaves the run's previous results as they were (before: Snakemake had deleted them).
4. The cluster path: run_config runs locally, the documented resource overrides add to the profile, and a CUDA
   preset whose jobs would get no GPU is refused before its first job (a dry run warns).
5. Conventions: TRL's names, trackers from the command line, a readable "what changed" line, results in
   `snakemake --report`, the dataset error's download command (adapters loadable from any directory:
   tests/test_traps.py), eval files keyed by their settings, and a `plan` that fits 100 columns and is quiet on a closed pipe.

Most tests reuse one finished 1-run slice of the `smoke` preset (`finished`, trained once for the module, 2 steps),
copying its folder, Snakemake's metadata included, so that each starts from "Nothing to be done".

    .venv/bin/pytest -q tests/test_newcomer.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RUN = "results/runs/single-sp-toy-math-s0-smoke"
TABLES = "results/presets/smoke/slice-workflow-single/tables"
SLICE = ["preset=smoke", "workflows=[single]"]


def snakemake(work: Path, *args, config=(), env=None, timeout=900, profile="local"):
    """`snakemake` on the repository's Snakefile, matrix and profile, run in `work` (its own results/)."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})}
    argv = [str(BIN / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), "--profile", str(ROOT / "profiles" / profile),
            *args, "--config", f"matrix={ROOT / 'matrix.yaml'}", *(config or SLICE)]  # fmt: skip
    return subprocess.run(argv, cwd=work, capture_output=True, text=True, env=env, timeout=timeout)


def marlflow(*args, cwd=ROOT, env=None, timeout=600):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        **(env or {}),
    }
    return subprocess.run([str(BIN / "marlflow"), *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip


def jobs(out: subprocess.CompletedProcess) -> dict[str, int]:
    """The job counts of a (dry) run's "Job stats" table; {} for "Nothing to be done"."""
    text = out.stdout + out.stderr  # a dry run prints its plan on stdout, a real run on stderr
    if "Job stats:" not in text:
        return {}
    table = text.split("Job stats:")[1].split("total")[0]
    return {
        p[0]: int(p[1])
        for p in (line.split() for line in table.splitlines())
        if len(p) == 2 and p[1].isdigit()
    }


def digest(path: Path) -> dict[str, bytes]:
    """{relative path: bytes} of a file, or of every file under a folder."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {p.relative_to(path.parent).as_posix(): p.read_bytes() for p in files}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A folder where `snakemake --config preset=smoke workflows=[single]` has finished: the shipped toy model
    copied by the models rule, one 2-step run, its tables and report."""
    work = tmp_path_factory.mktemp("finished")
    out = snakemake(work)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (work / RUN / "DONE").is_file() and (work / TABLES / "summary.csv").is_file()
    return work


@pytest.fixture
def work(finished, tmp_path):
    """A copy of the finished folder (mtimes and Snakemake's metadata kept): nothing to be done."""
    copy = tmp_path / "work"
    shutil.copytree(finished, copy, symlinks=True)
    return copy


# ---------------------------------------------------------------- 1. resume notices what is missing


def _trainer_pid(work: Path) -> int | None:
    """The pid of the `marlflow train` process running in `work`, if any."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if (
                b"train" in cmd
                and any(RUN.encode() in c for c in cmd)
                and Path(os.readlink(proc / "cwd")) == work
            ):
                return int(proc.name)
        except OSError:
            continue
    return None


@pytest.mark.slow
def test_a_run_deleted_moved_or_killed_is_retrained_and_the_tables_rebuilt(work, tmp_path):
    assert jobs(snakemake(work, "-n")) == {}
    run = work / RUN
    kept = tmp_path / "kept"
    shutil.copytree(run, kept, symlinks=True)
    for how in ("deleted", "moved"):
        shutil.rmtree(run) if how == "deleted" else run.rename(tmp_path / "elsewhere")
        planned = jobs(snakemake(work, "-n"))
        # before: "Nothing to be done", the tables still listing the run
        assert planned.get("train") == 1 and planned.get("aggregate") == 1 and planned.get("report") == 1, (
            how,
            planned,
        )
        shutil.rmtree(tmp_path / "elsewhere", ignore_errors=True)
        shutil.copytree(kept, run, symlinks=True)
    assert jobs(snakemake(work, "-n")) == {}
    # a retrain (forced, config unchanged) killed mid-way: the trainer dies, Snakemake reports the job failed
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    argv = [str(BIN / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), "--profile", str(ROOT / "profiles/local"),
            "-f", f"{RUN}/DONE", "--config", f"matrix={ROOT / 'matrix.yaml'}", *SLICE]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + 300
        while (pid := _trainer_pid(work)) is None and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert pid is not None, "the forced retrain never started"
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=300) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (run / "DONE").exists()
    before = (work / TABLES / "summary.csv").stat().st_mtime_ns
    out = snakemake(work)  # what `make run` runs
    assert out.returncode == 0, out.stderr[-3000:]
    assert jobs(out).get("train") == 1 and (run / "DONE").is_file()  # before: "Nothing to be done"
    assert (work / TABLES / "summary.csv").stat().st_mtime_ns > before  # the tables were rebuilt
    assert jobs(snakemake(work, "-n")) == {}


# ---------------------------------------------------------------- 2. model paths, and a failed start deletes nothing


def test_a_model_path_typo_is_refused_before_anything_runs(tmp_path):
    """Before: it passed validation, the models rule copied the shipped toy model anyway, and every train job
    failed late, after Snakemake had deleted its run's outputs."""
    text = (ROOT / "matrix.yaml").read_text()
    assert text.count("      toy: results/models/toy\n") == 1
    (tmp_path / "matrix.yaml").write_text(
        text.replace("      toy: results/models/toy\n", "      toy: results/models/tyo\n")
    )
    out = snakemake(tmp_path, "-n", config=["preset=smoke", "matrix=matrix.yaml"])
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    err = out.stderr
    assert "presets.smoke.models.toy: the model folder 'results/models/tyo' does not exist" in err, err
    assert "prepares scale toy's model in results/models/toy" in err and "Traceback" not in err
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_a_retrain_that_fails_before_training_leaves_the_previous_results(work):
    """The base model's folder is broken and the finished run is retrained (-f): the job fails loading it, and the
    run's metrics, samples, outcomes and final/ are byte for byte what they were. DONE is gone, so the run is
    unfinished and the next `snakemake` trains it again. A copy that a killed Snakemake left in its backup folder
    does not stop the job (before: FileExistsError)."""
    run = work / RUN
    kept = {
        name: digest(run / name)
        for name in ("metrics.parquet", "samples.parquet", "outcomes.parquet", "final")
    }
    tables = digest(work / TABLES)
    stale = work / ".snakemake" / "backups" / RUN / "final"
    shutil.copytree(run / "final", stale)
    (work / "results/models/toy/config.json").write_text("{not json")
    out = snakemake(work, "-f", f"{RUN}/DONE")
    assert out.returncode != 0 and "FileExistsError" not in out.stderr, out.stderr[-3000:]
    assert "marlflow train: run single-sp-toy-math-s0-smoke failed" in out.stderr + out.stdout
    assert "Restored previous version" in out.stderr + out.stdout
    for name, files in kept.items():
        assert digest(run / name) == files, name  # before: deleted when the job started
    assert digest(work / TABLES) == tables and not (run / "DONE").exists()
    assert jobs(snakemake(work, "-n")).get("train") == 1


# ---------------------------------------------------------------- 4. the cluster path


def test_a_cuda_preset_is_refused_where_its_jobs_get_no_gpu(tmp_path):
    """Before: `--config preset=paper` under profiles/local ran 42 CUDA runs' jobs on this CPU, the first failing
    with a traceback in the models rule. A dry run still plans them, with a warning; a real run stops before its
    first job."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: the local profile may run the paper preset")
    paper = ["preset=paper", "workflows=[single]", "scales=[0.6b]"]
    dry = snakemake(tmp_path, "-n", config=paper)
    assert dry.returncode == 0 and jobs(dry).get("train") == 2, dry.stderr[-2000:]
    assert "marlflow: warning: preset paper trains on device cuda" in dry.stderr
    out = snakemake(tmp_path, config=paper)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    err = out.stderr
    assert "error: preset paper trains on device cuda" in err and "would get no GPU" in err, err
    assert "--profile slurm" in err and "Nothing was run." in err and "Traceback" not in err
    assert not (tmp_path / "results" / "runs").exists() and not (tmp_path / "results" / "models").exists()


def _resources(out: str, rule: str) -> list[dict[str, str]]:
    blocks = [b for b in out.split("\nrule ")[1:] if b.startswith(f"{rule}:")]
    lines = [next(x for x in b.splitlines() if x.strip().startswith("resources:")) for b in blocks]
    return [
        dict(kv.split("=", 1) for kv in line.split(":", 1)[1].replace(" ", "").split(",")) for line in lines
    ]


@pytest.mark.slow
def test_cluster_overrides_add_to_the_profile_and_bookkeeping_runs_here(tmp_path):
    """The documented `--default-resources slurm_account=... slurm_partition=...` keeps every job's memory, time
    and CPUs from the profile (before: it replaced the profile's defaults, cpus_per_task among them), and
    `--config scale_resources=...` adds to the per-scale table. run_config runs on this node (localrules): with
    SLURM's commands stubbed (sbatch records its calls), its jobs finish under the SLURM executor and nothing is
    submitted; a dry run cannot show this, as it prints local jobs as `rule` too."""
    paper = ["preset=paper", "workflows=[voting]", "scales=[0.6b,4b]"]
    account = ("--default-resources", "slurm_account=acct", "slurm_partition=part")
    out = snakemake(ROOT, "-n", "--nolock", "--forceall", *account, profile="slurm",
                    config=[*paper, "scale_resources={4b: {runtime: 1440}}"])  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    for rule, want in (("aggregate", {"mem_mb": "16000", "runtime": "30", "cpus_per_task": "1"}),
                       ("report", {"mem_mb": "8000", "runtime": "30", "cpus_per_task": "1"})):  # fmt: skip
        for res in _resources(out.stdout, rule):
            assert {k: res.get(k) for k in want} == want and res["slurm_account"] == "acct", (rule, res)
    train = _resources(out.stdout, "train")
    # the signal lead per scale (profiles/slurm/config.yaml, the planner's signal_lead_s): 0.6b's and 4b's
    four = [r for r in train if r["mem_mb"] == "128000"]
    assert len(train) == 8 and {r["slurm_extra"] for r in train if r not in four} == {"--signal=USR1@4380"}
    assert {r["slurm_extra"] for r in four} == {"--signal=USR1@7500"}
    assert len(four) == 4 and all(r["runtime"] == "1440" and r["cpus_per_task"] == "16" for r in four)
    # run_config for real, under the SLURM executor, with stubs for SLURM's commands
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("sbatch", "squeue", "sacct", "sinfo", "sacctmgr", "scontrol", "sshare"):
        (fake / tool).write_text(f'#!/bin/sh\necho "$0 $*" >> {tmp_path}/calls-{tool}\nexit 1\n')
        (fake / tool).chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": f"{fake}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}"}
    out = snakemake(
        work, *account, "--until", "run_config", profile="slurm", config=paper, env=env, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert (
        len(list((work / "results" / "runs").glob("*/config.json"))) == 8
        and "localrule run_config:" in out.stderr
    )
    assert not (tmp_path / "calls-sbatch").exists(), (tmp_path / "calls-sbatch").read_text()


# ---------------------------------------------------------------- 5. conventions


def test_trl_names_are_accepted_and_documented(tmp_path):
    """`max_steps`, `num_generations`, `eval_steps` in a preset's grpo: (before: "not a known key"); both names at
    once is an error; docs/reference.md's table is the one the code generates."""
    from marlflow.core.config import trl_name_table

    text = (ROOT / "matrix.yaml").read_text()
    old = "grpo: {steps: 2, eval_every: 1, save_every: 1, problems_per_step: 2, group_size: 2}"
    assert text.count(old) == 1
    new = "grpo: {max_steps: 3, eval_steps: 1, save_steps: 1, problems_per_step: 2, num_generations: 4}"
    (tmp_path / "matrix.yaml").write_text(text.replace(old, new))
    out = marlflow("matrix", "matrix.yaml", "--preset", "smoke", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    grpo = json.loads(out.stdout)[0]["config"]["grpo"]
    assert (grpo["steps"], grpo["eval_every"], grpo["save_every"], grpo["group_size"]) == (3, 1, 1, 4)
    (tmp_path / "matrix.yaml").write_text(
        text.replace(old, old.replace("steps: 2,", "steps: 2, max_steps: 3,"))
    )
    out = marlflow("matrix", "matrix.yaml", "--preset", "smoke", cwd=tmp_path)
    assert out.returncode == 2 and "sets steps twice, as steps and as max_steps" in out.stderr, out.stderr
    assert trl_name_table() in (ROOT / "docs" / "reference.md").read_text()


@pytest.mark.slow
def test_trackers_from_the_command_line_retrain_nothing_and_reach_the_trainer(work):
    """`--config report_to=[tensorboard]` leaves config.json, the fingerprint and every finished run alone (before:
    report_to lived in matrix.yaml only, and changing it reran the runs); `MARLFLOW_REPORT_TO`, which it sets for
    the jobs, reaches the trainer; a name that is not a tracker is refused."""
    assert jobs(snakemake(work, "-n", config=[*SLICE, "report_to=[tensorboard]"])) == {}
    bad = snakemake(work, "-n", config=[*SLICE, "report_to=[tensorbord]"])
    assert bad.returncode == 2 and "'tensorbord', which is not a tracker" in bad.stderr, bad.stderr
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed: the trainer would start")
    done = (work / RUN / "DONE").read_bytes()
    out = marlflow("train", "--config", f"{RUN}/config.json", "--out", RUN, cwd=work,
                   env={"MARLFLOW_REPORT_TO": "wandb"})  # fmt: skip
    assert out.returncode == 1 and "report_to asks for wandb" in out.stderr, out.stderr[-2000:]
    assert (work / RUN / "DONE").read_bytes() == done  # a failed start leaves a finished run as it was


@pytest.mark.slow
def test_what_changed_is_one_line_per_run(work):
    """Before: only Snakemake's "Params have changed", two whole 1.5 KB configs per run."""
    text = (ROOT / "matrix.yaml").read_text()
    old = "grpo: {steps: 2, eval_every: 1,"
    (work / "matrix.yaml").write_text(text.replace(old, "grpo: {steps: 3, eval_every: 1,"))
    out = snakemake(work, "-n", config=[*SLICE, "matrix=matrix.yaml"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "marlflow: 1 run(s) changed in matrix.yaml" in out.stderr, out.stderr[-2000:]
    assert "  single-sp-toy-math-s0-smoke: grpo.steps: 2 -> 3\n" in out.stderr


@pytest.mark.slow
def test_snakemake_report_holds_the_results(work):
    """Before: nothing was tagged report(), so `snakemake --report` held the workflow and no results."""
    out = snakemake(work, "--report", "r.html")
    assert out.returncode == 0, out.stderr[-2000:]
    for name in ("summary.csv", "claims.md", "curves.png", "report.html"):
        assert f"Adding {name} (" in out.stderr, name  # Snakemake embeds each result it was told of
    html = (work / "r.html").read_text(errors="ignore")
    assert all(f'"{c}"' in html for c in ("Tables", "Figures", "Report"))  # the results' categories


def test_an_offline_dataset_error_names_the_download_command(tmp_path):
    """Before: "Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)" and nothing else."""
    from marlflow.core.config import GRPOParams, RunConfig, TaskSpec

    cfg = RunConfig(run_id="single-sp-toy-math-s0", workflow="single", sharing="sp", scale="toy", task_axis="math",
                    seed=0, task=TaskSpec(name="gsm8k", eval_size=2), model="results/models/toy",
                    grpo=GRPOParams(steps=1, eval_every=1))  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    empty = tmp_path / "hf"
    env = {
        "HF_HOME": str(empty),
        "HF_DATASETS_CACHE": str(empty / "datasets"),
        "HF_HUB_CACHE": str(empty / "hub"),
    }
    out = marlflow("train", "--config", "config.json", "--out", "run", cwd=tmp_path, env=env)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "HF_HUB_OFFLINE=1 and it is not in the local cache" in out.stderr, out.stderr[-2000:]
    assert (
        "`HF_HUB_OFFLINE=0 python -c \"import datasets; datasets.load_dataset('openai/gsm8k', 'main')\"`"
        in out.stderr
    )


@pytest.mark.slow
def test_eval_files_are_keyed_by_their_settings(work):
    """Before: `marlflow eval` with another --n overwrote evals/<task>-step<N>.json."""
    for n in ("2", "3"):
        out = marlflow("eval", "--run", RUN, "--n", n, cwd=work)
        assert out.returncode == 0, out.stderr[-2000:]
    evals = work / RUN / "evals"
    two, three = (json.loads((evals / f"toy_math-step2-n{n}-tok24.json").read_text()) for n in (2, 3))
    assert (two["n_eval"], three["n_eval"]) == (2, 3)
    assert (evals / "toy_math-step2-n2-tok24-outcomes.parquet").is_file()
    assert json.loads((evals / "toy_math-step2.json").read_text())["n_eval"] == 3  # the newest, as before


def test_plan_fits_100_columns_and_is_quiet_on_a_closed_pipe():
    """Before: 15 columns of 300-character rows, and `--format csv | head` ended in a BrokenPipeError traceback."""
    out = marlflow("plan", "--preset", "paper")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert lines[0].startswith("42 of 42 runs fit") and "--details" in out.stdout  # the summary first
    assert len([x for x in lines if x.startswith("| ") and "run_id" not in x]) == 42
    details = marlflow("plan", "--preset", "paper", "--details")
    assert "adapters+AdamW GB" in details.stdout and "adapters+AdamW GB" not in out.stdout
    for fmt in ("csv", "md"):  # `true` reads nothing: the pipe is closed before the first write
        piped = subprocess.run(["bash", "-o", "pipefail", "-c", f"{BIN / 'marlflow'} plan --preset paper --details "
                                f"--format {fmt} | true"], capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
        assert piped.returncode == 0 and piped.stderr == "", piped.stderr
