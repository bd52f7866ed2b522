"""The rules tell the truth: every file a real pipeline writes is a declared output, and `--profile slurm` works.

`test_smoke_pipeline_writes_only_declared_files` runs the `smoke` preset (3 runs of 2 steps, aggregate,
report) end to end with Snakemake in a temp folder, on the test session's offline toy model, then compares every
file under results/ with what `snakemake --summary` (outputs and logs) and the jobs' `benchmark:` files
declare. Two things are undeclared on purpose: RUN/checkpoints/, the train job's resume state (see
rules/train.smk for why it must not be an output), and RUN/environment.jsonl, where each start of training
ran (marlflow.training.environment), which a resumed job appends to.
"""

from __future__ import annotations

import json
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


def snakemake(*args, cwd=ROOT, check=True, timeout=300, venv_on_path=True):
    path = [p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != BIN]
    # venv_on_path=False: `.venv/bin/snakemake` run without activating the venv, as users do; the jobs'
    # `python -m marlflow.<verb>` must still find marlflow (marlflow.pipeline.matrix.jobs_use_this_python).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": os.pathsep.join([str(BIN)] * venv_on_path + path)}
    out = subprocess.run([str(SNAKEMAKE), *args], cwd=cwd, capture_output=True, text=True, env=env,
                         timeout=timeout)  # fmt: skip
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_slurm_profile_from_the_repository_root_plans_the_paper_matrix():
    """The exact command users are told to type: `--profile slurm` finds ./slurm -> profiles/slurm."""
    link = ROOT / "slurm"
    assert link.is_symlink() and os.readlink(link) == "profiles/slurm"
    # slurm_account: the shipped CHANGE_ME is refused before planning (tests/test_traps.py)
    out = snakemake("--profile", "slurm", "-n", "--forceall", "--default-resources", "slurm_account=myacct",
                    "slurm_partition=gpu", "--config", "preset=paper")  # fmt: skip
    table = out.stdout.split("Job stats:")[1].split("total")[0]
    counts = {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}
    assert counts["train"] == 42 and counts["models"] == 3
    # The profile's per-scale table (profiles/slurm/scale_resources.yaml) was found through the link.
    train = [b for b in out.stdout.split("rule ")[1:] if b.startswith("train:")]
    assert len(train) == 42 and all("gpu=1" in re.search(r"resources: (.*)", b)[1] for b in train)


@pytest.mark.slow
def test_shell_commands_take_their_paths_from_the_rule():
    """No output folder is spelled out in a shell line: --out/--figures/--pages/--tables come from {output}
    or {input}, so renaming an output cannot leave a command writing to the old place."""
    out = snakemake("-n", "--forceall", "-p", "--profile", "profiles/local", "--config", "preset=smoke")
    shells = [  # the train rule's shell is `exec python -m ...` (marlflow.training.preempt: signals reach the trainer)
        line.removeprefix("Shell command: ").removeprefix("exec ")
        for line in out.stdout.splitlines()
        if "command: python -m" in line or "command: exec python -m" in line
    ]
    # Every rule calls a `marlflow` command (python -m marlflow VERB), never a module path that a re-housing moves.
    assert {tuple(s.split()[2:4]) for s in shells} >= {
        ("marlflow", v) for v in ("models", "train", "aggregate", "report")
    }
    for rule_file in ("models.smk", "train.smk", "report.smk"):
        for block in (ROOT / "rules" / rule_file).read_text().split("shell:")[1:]:
            shell = block.split("\nrule ")[0]  # this rule's shell command, not the next rule's outputs
            assert "results/" not in shell, (rule_file, shell)


def _declared(workdir: Path, args: list[str]) -> tuple[set[str], set[str]]:
    """(declared files, declared folders) relative to workdir: --summary outputs and logs, benchmarks."""
    summary = snakemake("--summary", *args, cwd=workdir).stdout
    files, folders = set(), set()
    for line in summary.splitlines()[1:]:
        cols = line.split("\t")
        if len(cols) < 5 or not cols[0].startswith("results/"):
            continue
        output, logs, status = cols[0], cols[3], cols[4]
        assert status == "ok", line
        (folders if (workdir / output).is_dir() else files).add(output)
        files.update(p.strip() for p in logs.split(",") if p.strip() not in ("", "-"))
    plan = snakemake("-n", "--forceall", *args, cwd=workdir).stdout
    files.update(re.findall(r"^\s+benchmark: (\S+)$", plan, re.M))
    return files, folders


@pytest.mark.slow
def test_smoke_pipeline_writes_only_declared_files(toy_model_dir, tmp_path):
    from marlflow.training import environment

    work = tmp_path / "work"
    model = work / "results" / "models" / "toy"
    shutil.copytree(toy_model_dir, model)
    # A prepared model folder, as `marlflow models prepare` leaves it: the models rule need not rebuild it.
    (model / "READY").write_text(json.dumps({"scale": "toy", "model": str(model.resolve())}))
    args = [
        "--snakefile",
        str(ROOT / "Snakefile"),
        "--config",
        "preset=smoke",
        f"matrix={ROOT / 'matrix.yaml'}",
    ]
    snakemake("--cores", "2", *args, cwd=work, timeout=1500, venv_on_path=False)

    files, folders = _declared(work, args)
    runs = sorted(p.name for p in (work / "results" / "runs").iterdir() if not p.name.startswith("."))
    assert len(runs) == 3
    # The cells' shared step-0 evaluations (marlflow.training.base_eval), a cache beside the runs like their
    # checkpoints: one for single, one read by both Voting runs, and no claim left behind.
    shared = sorted(p.name for p in (work / "results" / "runs" / ".base-evals").iterdir())
    assert len(shared) == 6 and sum(n.endswith("-outcomes.parquet") for n in shared) == 2, shared
    undeclared = []
    for path in sorted((work / "results").rglob("*")):
        rel = path.relative_to(work).as_posix()
        if path.is_dir() and any(path.iterdir()):
            continue  # a folder is judged by its files
        inside = any(rel == d or rel.startswith(d + "/") for d in folders)
        on_purpose = re.match(
            r"results/runs/([^/]+/checkpoints|[^/]+/environment\.jsonl|[^/]+/\.trainer\.lock|\.base-evals)(/|$)",
            rel,
        )
        if rel not in files and not inside and not on_purpose:
            undeclared.append(rel + ("/ (empty folder)" if path.is_dir() else ""))
    assert not undeclared, "written but not declared by any rule:\n" + "\n".join(undeclared)
    for run_id in runs:
        run = work / "results" / "runs" / run_id
        assert (run / "DONE").is_file() and (run / "final" / "README.md").is_file()
        assert [r["step"] for r in environment.read(run)] == [0]
        assert f"results/benchmarks/train/{run_id}.tsv" in files
        assert (work / f"results/benchmarks/train/{run_id}.tsv").is_file()
    # Every file declared is there (a rule that declares more than it writes would fail the job anyway).
    missing = [f for f in files | folders if not (work / f).exists() and "/logs/models/" not in f]
    assert not missing, missing
