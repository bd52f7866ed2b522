"""Atomic file writers: every file marlflow writes goes through one of these.

Each writes a temp file in the destination folder, fsyncs it and `os.replace`s it over the target, so a
killed job leaves either the old file or the new one, never a torn one. Results get ordinary permissions
(0666 less the umask), not mkstemp's 0600.

    from marlflow.store.atomic import atomic_write_json
    atomic_write_json("results/runs/x/progress.json", {"step": 3})
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pandas as pd
import pyarrow as pa


def _atomic_path(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(tmp)


_UMASK = os.umask(0)
os.umask(_UMASK)


def _commit(tmp: Path, path: Path) -> None:
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; results are ordinary files
    os.replace(tmp, path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    tmp = _atomic_path(path)
    try:
        tmp.write_bytes(data)
        _commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_write_parquet(df: pd.DataFrame, path: str | os.PathLike, schema: pa.Schema | None = None) -> None:
    path = Path(path)
    tmp = _atomic_path(path)
    try:
        table = pa.Table.from_pandas(df, schema=schema, preserve_index=False)
        import pyarrow.parquet as pq

        pq.write_table(table, tmp)
        _commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
