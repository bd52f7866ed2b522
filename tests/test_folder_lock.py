"""One trainer per run folder (marlflow.store.lock), through real `marlflow train` processes and signals.

- A second trainer of a folder whose trainer is alive exits 3 at once, names the holder and writes nothing;
  the first trains on and finishes.
- A trainer killed with SIGKILL leaves its lock file but not the lock: the next start takes it without any
  cleanup and resumes.
- A failed start that wrote nothing leaves no folder behind (the lock file is not "something").
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marlflow.store.lock import LOCK_NAME, FolderLocked, folder_lock


def _train(cfg_path: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "marlflow", "train", "--config", str(cfg_path), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _holder_pid(run: Path) -> int | None:
    try:
        return json.loads((run / LOCK_NAME).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def test_folder_lock_in_process(tmp_path):
    """The library: held, a second taker is refused naming the holder; released on exit; a folder it created
    and left with nothing but the lock is removed."""
    run = tmp_path / "run"
    with folder_lock(run, "test") as path:
        assert path == run / LOCK_NAME and json.loads(path.read_text())["pid"] == os.getpid()
        refused = pytest.raises(FolderLocked, match=rf"in use by another trainer \(pid {os.getpid()} on host")
        with refused, folder_lock(run):
            pass
        (run / "metrics.parquet").write_text("x")
    with folder_lock(run):  # released: taken again
        pass
    assert run.is_dir()  # it holds a file: kept
    fresh = tmp_path / "fresh"
    with folder_lock(fresh):
        (fresh / "checkpoints").mkdir()
    assert not fresh.exists()


@pytest.mark.slow
def test_folder_lock_second_trainer_refused_and_sigkill_recovered(make_cfg, tmp_path):
    cfg = make_cfg("single", "sp", steps=4)
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))
    run = tmp_path / "run"

    first = _train(cfg_path, run)
    deadline = time.time() + 120
    while _holder_pid(run) != first.pid:  # the first trainer holds the folder
        assert first.poll() is None and time.time() < deadline, first.communicate()[1]
        time.sleep(0.2)
    second = _train(cfg_path, run)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 3, err
    assert f"in use by another trainer (pid {first.pid} on host" in err and "rerun to resume" in err
    assert first.poll() is None  # untouched by the refused start

    # SIGKILL the holder once it has a checkpoint: the kernel drops the lock, the file stays
    while not list((run / "checkpoints").glob("step-*")):
        assert first.poll() is None and time.time() < deadline + 240, first.communicate()[1]
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    assert (run / LOCK_NAME).exists() and _holder_pid(run) == first.pid
    third = _train(cfg_path, run)
    out, err = third.communicate(timeout=600)
    assert third.returncode == 0, err
    assert "resumed from" in err and (run / "DONE").is_file()
    assert _holder_pid(run) == third.pid
