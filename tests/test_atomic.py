"""Atomic writes under injected crashes: the old file survives, nothing torn is ever consumed.

marlflow.store.schema' writers put a temp file `.NAME.<random>.tmp` next to the destination and `os.replace`
it. A crash mid-write (an exception, a full disk, or SIGKILL) must leave the previous file intact and
readable; an exception must also remove the temp file, and what SIGKILL leaves behind is hidden and ends
in `.tmp`, so no rule, glob or reader ever takes it for the real output. Checkpoints are folders written
the same way (`.step-N.tmp` renamed to `step-N` after `COMPLETE`); a full disk while writing one keeps the
previous checkpoint loadable and says what to do.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import pathlib
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from marlflow.cli import train as T
from marlflow.store import atomic as MM
from marlflow.tasks import register
from marlflow.tasks.toy import ToyMath
from marlflow.training import checkpoint
from marlflow.training.checkpoint import DiskFullError

OLD = pd.DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"]})
NEW = pd.DataFrame({"a": list(range(1000)), "b": ["new"] * 1000})


@register("atomic_parity")
class Parity(ToyMath):
    name = "atomic_parity"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


def _write(kind: str, path: Path, new: bool) -> None:
    if kind == "parquet":
        MM.atomic_write_parquet(NEW if new else OLD, path)
    else:
        MM.atomic_write_json(path, {"v": "new" * 1000} if new else {"v": "old"})


def _assert_old(kind: str, path: Path) -> None:
    if kind == "parquet":
        pd.testing.assert_frame_equal(pd.read_parquet(path), OLD)
    else:
        assert json.loads(path.read_text()) == {"v": "old"}


def _leftovers(path: Path) -> list[Path]:
    return [p for p in path.parent.iterdir() if p != path]


# A child process that starts the real writer, lets it put part of the temp file on disk, then is SIGKILLed.
CHILD = """
import os, pathlib, signal, sys
import pandas as pd
import pyarrow.parquet as pq
from marlflow.store import atomic as metrics
def torn(where):  # part of the temp file reaches the disk, then the process dies without any cleanup
    with open(where, "wb") as fh:
        fh.write(b"PARTIAL" * 100)
        fh.flush()
        os.fsync(fh.fileno())
    os.kill(os.getpid(), signal.SIGKILL)

pq.write_table = lambda table, where, *a, **k: torn(where)
pathlib.Path.write_bytes = lambda self, data: torn(self)
kind, path = sys.argv[1], pathlib.Path(sys.argv[2])
if kind == "parquet":
    metrics.atomic_write_parquet(pd.DataFrame({"a": [9]}), path)
else:
    metrics.atomic_write_json(path, {"v": "new"})
"""


@pytest.mark.parametrize("kind", ["parquet", "json"])
def test_sigkill_mid_write_keeps_old_file(tmp_path, kind):
    path = tmp_path / ("metrics.parquet" if kind == "parquet" else "DONE")
    _write(kind, path, new=False)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    _assert_old(kind, path)
    # the torn temp file is there (the kill really was mid-write), hidden and not named like any output
    (left,) = _leftovers(path)
    assert left.name.startswith(f".{path.name}.") and left.name.endswith(".tmp")
    assert left.read_bytes() == b"PARTIAL" * 100
    assert list(tmp_path.glob("*.parquet")) == ([path] if kind == "parquet" else [])
    assert [p.name for p in tmp_path.glob("*") if not p.name.startswith(".")] == [path.name]
    # the next write succeeds and replaces the file whole
    _write(kind, path, new=True)
    if kind == "parquet":
        pd.testing.assert_frame_equal(pd.read_parquet(path), NEW)
    else:
        assert json.loads(path.read_text())["v"].startswith("new")


@pytest.mark.parametrize("kind", ["parquet", "json"])
@pytest.mark.parametrize("existed", [True, False])
def test_disk_full_mid_write_cleans_up(tmp_path, monkeypatch, kind, existed):
    """OSError(ENOSPC) after part of the temp file is written: the error propagates, the old file (or no
    file) is what is there, and no temp file is left."""
    path = tmp_path / ("metrics.parquet" if kind == "parquet" else "DONE")
    if existed:
        _write(kind, path, new=False)

    def full(where):
        Path(where).write_bytes(b"PAR1partial") if kind == "parquet" else None
        raise OSError(errno.ENOSPC, "No space left on device", str(where))

    if kind == "parquet":
        monkeypatch.setattr(pq, "write_table", lambda table, where, *a, **k: full(where))
    else:
        real = pathlib.Path.write_bytes

        def write_bytes(self, data):
            real(self, data[: len(data) // 2])
            full(self)

        monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    with pytest.raises(OSError) as exc:
        _write(kind, path, new=True)
    assert exc.value.errno == errno.ENOSPC
    if existed:
        _assert_old(kind, path)
    else:
        assert not path.exists()
    assert _leftovers(path) == []


def test_failed_rename_cleans_up(tmp_path, monkeypatch):
    path = tmp_path / "metrics.parquet"
    _write("parquet", path, new=False)

    def no_replace(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", str(dst))

    monkeypatch.setattr(MM.os, "replace", no_replace)
    with pytest.raises(PermissionError):
        _write("parquet", path, new=True)
    _assert_old("parquet", path)
    assert _leftovers(path) == []


def test_torn_checkpoints_are_never_resumed_from(tmp_path):
    """What a kill mid-checkpoint leaves (a `.step-N.tmp` folder, a `step-N` without COMPLETE) is ignored."""
    root = tmp_path / "checkpoints"
    (root / "step-2").mkdir(parents=True)
    (root / "step-2" / "COMPLETE").write_text('{"step": 2}')
    (root / ".step-3.tmp" / "adapters").mkdir(parents=True)
    (root / ".step-3.tmp" / "state.pt").write_bytes(b"torn")
    (root / "step-3").mkdir()
    (root / "step-3" / "state.pt").write_bytes(b"torn")
    found = checkpoint.complete(tmp_path)
    assert [p.name for p in found] == ["step-2"]


@pytest.mark.slow
def test_disk_full_while_writing_a_checkpoint(make_cfg, tmp_path, monkeypatch, capsys):
    """torch.save fails with ENOSPC half-way through the step-2 checkpoint: the run stops with a message
    that says the disk is full and what to do, step-1 is intact and loadable, no torn folder is left, and
    once space is free the rerun resumes from step 1 and finishes."""
    cfg = make_cfg("single", "sp", task="atomic_parity", steps=2, eval_every=2, save_every=1)
    cfg_path, out = tmp_path / "config.json", tmp_path / "run"
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == 2:
            Path(f).write_bytes(b"\x80\x02partial")  # part of the file reached the disk
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(
        DiskFullError, match=r"disk full while writing the step-2 checkpoint .*step-1 is intact"
    ):
        T.run(cfg, out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]
    assert not (out / "DONE").exists() and not (out / "metrics.parquet").exists()
    state = torch.load(out / "checkpoints" / "step-1" / "state.pt", weights_only=False)
    assert state["step"] == 1
    # the CLI: resumes from step 1, hits the full disk again, one clear line, exit 1, nothing lost
    assert T.main(["--config", str(cfg_path), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("marlflow train:")]
    assert "disk full" in line and "Free disk space" in line and "resumes from the newest complete" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]
    # space freed: the rerun resumes and finishes
    monkeypatch.setattr(torch, "save", real_save)
    assert T.main(["--config", str(cfg_path), "--out", str(out)]) == 0
    assert json.loads((out / "DONE").read_text())["steps"] == 2
    m = pd.read_parquet(out / "metrics.parquet")
    assert sorted(m[m.split == "train"].step.unique()) == [1, 2]
