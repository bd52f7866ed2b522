"""One trainer per run folder: an exclusive lock on RUN/.trainer.lock for as long as the trainer lives.

    with folder_lock(run_dir, what="marlflow train"):   # FolderLocked if another process holds it
        ...train...

Two trainers writing one run folder would interleave checkpoints and outputs (each resuming from the other's
checkpoints, both writing metrics.parquet). `marlflow train` therefore takes this lock before it starts (the
launcher of a data-parallel run takes it once for all its ranks) and a second trainer of the same folder is
refused at once with the holder's pid, host and start time.

The lock is the kernel's (`flock` on an open file), not the file's existence: it is released when the holding
process exits however it exits (crash, SIGKILL, OOM kill), so a stale lock from a killed trainer is recovered
by the next start with nothing to clean up. The file itself stays, holding the last holder's details. On
NFS, Linux implements `flock` with the server's byte-range locks (NFSv4, or v3 with lockd); on a filesystem
without working locks the open fails loudly rather than letting two trainers in silently.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".trainer.lock"


class FolderLocked(RuntimeError):
    """Another live process holds the run folder's lock; the message names it and what to do."""


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, what: str = "a trainer") -> Iterator[Path]:
    """Hold the exclusive lock on `folder`/.trainer.lock (the folder is created if needed) while the block
    runs; raise FolderLocked at once if another process holds it. Yields the lock file's path. A folder this
    call created is removed again on the way out if the block left no file in it but the lock (a run that
    failed before writing anything leaves no folder behind)."""
    folder = Path(folder)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children (PEP 446)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            raise FolderLocked(
                f"{folder} is in use by another trainer ({holder}); two trainers of one run folder would "
                "overwrite each other's checkpoints and outputs. Wait for it to finish, or stop it (its lock is "
                "released when it exits, also when killed) and rerun to resume"
            ) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        yield path
    finally:
        os.close(fd)  # closing the last descriptor releases the lock
        if created:
            _remove_if_only_lock(folder)


def _remove_if_only_lock(folder: Path) -> None:
    """Remove `folder` if it holds no file but the lock (empty subfolders go with it)."""
    files = [p for p in folder.rglob("*") if not p.is_dir()]
    if files != [folder / LOCK_NAME]:
        return
    (folder / LOCK_NAME).unlink(missing_ok=True)
    for d in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        folder.rmdir()


def _read_holder(fd: int) -> str:
    """The holder's details as written at its start: 'pid P on host H since T', or a note when unreadable."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on host {info['host']} since {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its details are not written yet"
