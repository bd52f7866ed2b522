"""What a run trained on: one line in RUN_DIR/environment.jsonl per start of a training process.

A run that is killed or preempted resumes from its newest checkpoint, possibly on another node with another
CPU, GPU, torch or checkout, and on a CPU the kernels decide the rounding (README, "On another CPU"). So rank 0
appends, each time training starts (fresh at step 0 or resumed at the checkpoint's step), one JSON line:

    step                  the step training starts from: 0, or the resumed checkpoint's step
    time                  UTC, ISO 8601
    hostname              rank 0's host; hosts: every rank's, in rank order
    cpu_model, cpu_flags  marlflow.models.toybuild.cpu_info: /proc/cpuinfo's model and its kernel-relevant flags
    torch                 torch.__version__; torch_cpu_capability: the CPU kernels torch picked (AVX512, ...)
    cuda_device           the GPU's name when the run uses CUDA, else ""
    torch_threads         torch.get_num_threads(); omp_num_threads: $OMP_NUM_THREADS ("" when unset)
    ranks                 data-parallel ranks (marlflow.training.distributed)
    marlflow              marlflow.__version__; commit: source_commit() of the package ("" outside a checkout)

The file is provenance only: it is no Snakemake output, no checkpoint holds it and no config fingerprint reads
it, so two runs that trained alike compare equal whatever machines they ran on (tests/test_resume.py).
`python -m marlflow evidence collect` groups its lines (`distinct`) into provenance.json's
`environments`; the report's Provenance section names each one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from marlflow.store.atomic import atomic_write_text

ENVIRONMENT_FILE = "environment.jsonl"
# Fields that say when and where a start happened rather than what it ran with: two starts that differ only
# in them ran in the same environment (`distinct` groups on the other fields).
WHEN_AND_WHERE = ("step", "time", "hostname", "hosts")
PACKAGE_DIR = Path(__file__).resolve().parent


def source_commit(path: str | os.PathLike = PACKAGE_DIR, short: bool = False) -> str:
    """HEAD of the git checkout whose tracked files include `path`, with "+dirty" when tracked files differ from
    it; "" when `path` is not tracked in one (an installed package, even inside a checkout's ignored .venv) or
    git is missing or stalls. Never raises."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=20)

    try:
        head = git("rev-parse", *(["--short"] if short else []), "HEAD")
        if head.returncode != 0 or git("ls-files", "--error-unmatch", ".").returncode != 0:
            return ""
        dirty = (
            git("diff", "--quiet", "HEAD", "--").returncode == 1
        )  # diff, not status: never takes the index lock
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty else "")


def record(step: int, device: str, hosts: list[str]) -> dict:
    """This process's environment record (the module docstring) for a start at `step`, on `device`, with
    `hosts` the hostname of each rank (rank 0's first)."""
    import torch

    import marlflow
    from marlflow.models.toybuild import (
        cpu_info,  # the parsing warmstart.json's cpu_model / cpu_flags come from
    )

    return {
        "step": step,
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "hostname": hosts[0],
        "hosts": hosts,
        **cpu_info(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda_device": torch.cuda.get_device_name() if device == "cuda" else "",
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "ranks": len(hosts),
        "marlflow": marlflow.__version__,
        "commit": source_commit(),
    }


def read(run_dir: str | os.PathLike) -> list[dict]:
    """The run's records, oldest first; [] when it has no environment.jsonl (runs trained before it existed)."""
    path = Path(run_dir) / ENVIRONMENT_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def since_fresh_start(records: list[dict]) -> list[dict]:
    """The records from the last start at step 0 on: the starts whose training the run's results hold. A fresh
    start discards what earlier ones trained (a config changed, its checkpoints superseded; a kill before the
    first checkpoint)."""
    fresh = [i for i, r in enumerate(records) if r["step"] == 0]
    return records[fresh[-1] if fresh else 0 :]


def record_start(run_dir: str | os.PathLike, step: int, device: str) -> None:
    """Append this start's record to run_dir/environment.jsonl (rank 0 writes; every rank must call it, as it
    gathers each rank's hostname). The whole file is rewritten atomically, so a kill leaves the old or new one."""
    from marlflow.training import distributed

    hosts = distributed.gather(socket.gethostname())
    if not distributed.is_main():
        return
    lines = [json.dumps(r, sort_keys=True) for r in [*read(run_dir), record(step, device, hosts)]]
    atomic_write_text(Path(run_dir) / ENVIRONMENT_FILE, "\n".join(lines) + "\n")


def distinct(run_dirs: dict[str, Path]) -> tuple[list[dict], list[str]]:
    """(environments, unrecorded run ids) of run id -> run folder: each distinct environment the runs' results
    were trained in (since_fresh_start of its environment.jsonl; WHEN_AND_WHERE left
    out of what makes one distinct) with the hosts and run ids that used it, in order of first use."""
    found: dict[str, dict] = {}
    unrecorded = []
    for run_id, folder in run_dirs.items():
        starts = since_fresh_start(read(folder))
        if not starts:
            unrecorded.append(run_id)
        for r in starts:
            env = {k: v for k, v in r.items() if k not in WHEN_AND_WHERE}
            entry = found.setdefault(json.dumps(env, sort_keys=True), {**env, "hosts": [], "runs": []})
            for host in r["hosts"]:
                if host not in entry["hosts"]:
                    entry["hosts"].append(host)
            if run_id not in entry["runs"]:
                entry["runs"].append(run_id)
    return list(found.values()), unrecorded
