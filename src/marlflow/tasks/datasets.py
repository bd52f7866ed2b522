"""Dataset loading for the hub tasks (marlflow.tasks.math, marlflow.tasks.code, marlflow.tasks.deepcoder_runtime):
local .jsonl/.json/.parquet files or hub datasets, read into rows that remember their file and line, checked
field by field with errors that name the file, the line, the field and the fix.

    rows, is_split = source_rows(spec, "test", "openai/gsm8k", "main", "test")   # spec: a config.TaskSpec
    question = field(rows, 0, "question")                                         # DataError if missing/wrong
    train, test = split_records(rows, 0.1, seed=42)     # = datasets' train_test_split(0.1, seed=42)

`datasets.load_dataset` is called only in `load_hub`, and only through `HUB_LOAD_DATASET` when that is set,
which is how tests stand a local file in for a download.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

from marlflow.tasks import Problem

HUB_LOAD_DATASET: Callable | None = None  # tests: a load_dataset-like function that reads local files


class DataError(ValueError):
    """A dataset that cannot be used; the message names the file, the line or row, the field and the fix."""

    def __str__(self) -> str:
        # A message quotes values from the file; whatever they hold, it stays one readable paragraph.
        text = " ".join(super().__str__().split())
        return text if len(text) <= 2000 else text[:1980] + " ... (cut)"


class Records(list):
    """Dataset rows that remember where they came from, so an error can name the file and line."""

    def __init__(self, rows, origin: str, lines: list[int] | None = None):
        super().__init__(rows)
        self.origin, self.lines = origin, lines

    def where(self, i: int) -> str:
        if self.lines is not None:
            return f"{self.origin} line {self.lines[i]}"
        return f"{self.origin} row {i + 1}"


_KINDS = {
    "text": "a string",
    "answer": "a string or a number",
    "int": "an integer",
    "text_list": "a list of strings",
}


def field(rows: Records, i: int, key: str, kind: str = "text", default=None, required: bool = True):
    """Row i's `key`, checked to be of `kind` (see _KINDS); DataError naming the file, line and field.

    Parquet gives numpy arrays and numpy scalars where JSON gives lists and ints; both are accepted."""
    row = rows[i]
    where = rows.where(i) if isinstance(rows, Records) else f"row {i + 1}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: the row is a JSON {type(row).__name__}, not an object with named fields")
    v = row.get(key)
    if v is None:
        if not required:
            return default
        have = ", ".join(str(k)[:40] for k in list(row)[:12]) or "none"
        raise DataError(
            f"{where}: field {key!r} is {'null' if key in row else 'missing'}; it must be {_KINDS[kind]} "
            f"(fields present: {have}). Fix the file, or point task.source at the dataset in its original format"
        )
    if hasattr(v, "tolist") and not isinstance(v, str | bytes):
        v = v.tolist()  # numpy array or scalar from parquet
    ok = {
        "text": isinstance(v, str),
        "answer": isinstance(v, str | int | float) and not isinstance(v, bool),
        "int": (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, str) and v.strip().lstrip("-").isdigit()),
        "text_list": isinstance(v, list | tuple) and all(isinstance(x, str) for x in v),
    }[kind]
    if not ok:
        r = repr(v)
        r = r if len(r) <= 80 else r[:60] + f"... ({len(r)} characters)"
        raise DataError(
            f"{where}: field {key!r} is {r} of type {type(v).__name__}; it must be {_KINDS[kind]}"
        )
    return int(v) if kind == "int" else list(v) if kind == "text_list" else v


def read_records(path: str | Path, key: str = "task.source") -> Records:
    """Rows of a local .jsonl, .json (list) or .parquet file (or .jsonl.gz), with their line numbers."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"dataset file {str(p)!r} {what}; fix `{key}` for this task in matrix.yaml "
            "(a local .jsonl/.json/.parquet file, or leave it empty to use the hub dataset)"
        )
    name = p.name.lower()
    if name.endswith(".parquet"):
        import pandas as pd

        try:
            return Records(pd.read_parquet(p).to_dict("records"), str(p))
        except Exception as err:  # noqa: BLE001 - pyarrow raises many types for a broken file
            raise DataError(
                f"dataset file {str(p)!r} is not a readable parquet file ({type(err).__name__}: "
                f"{str(err)[:200]}); fix `{key}` in matrix.yaml"
            ) from None
    try:
        if name.endswith(".gz"):
            import gzip

            with gzip.open(p, "rb") as f:
                data = f.read()
        else:
            data = p.read_bytes()
    except (OSError, EOFError) as err:
        raise DataError(
            f"dataset file {str(p)!r} cannot be read ({err}); fix `{key}` in matrix.yaml"
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise DataError(
            f"dataset file {str(p)!r} line {line}: not UTF-8 (byte 0x{data[err.start]:02x}); "
            "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    if name.endswith(".json") and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(
                f"dataset file {str(p)!r} line {err.lineno}: not valid JSON ({err.msg})"
            ) from None
        except RecursionError:
            raise DataError(f"dataset file {str(p)!r}: JSON nested too deeply") from None
        return Records(rows, str(p))
    rows, lines = [], []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise DataError(
                f"dataset file {str(p)!r} line {n}: not valid JSON ({err.msg} at column {err.colno}); "
                "a .jsonl file holds one JSON object per line"
            ) from None
        except RecursionError:
            raise DataError(f"dataset file {str(p)!r} line {n}: JSON nested too deeply") from None
        lines.append(n)
    return Records(rows, str(p), lines)


def split_records(rows: list, test_size: float | int, seed: int = 42, shuffle_only: bool = False):
    """(train, test) exactly as `datasets.Dataset.train_test_split(test_size, seed=seed)` makes them
    (a float is a fraction, an int a count); with `shuffle_only` as `shuffle(seed)` then the first
    `test_size` rows are the test split."""
    import numpy as np

    n = len(rows)
    perm = np.random.default_rng(seed).permutation(n)
    if shuffle_only:
        n_test = int(test_size)
        return [rows[i] for i in perm[n_test:]], [rows[i] for i in perm[:n_test]]
    n_test = math.ceil(test_size * n) if isinstance(test_size, float) else int(test_size)
    n_train = math.floor((1 - test_size) * n) if isinstance(test_size, float) else n - n_test
    return [rows[i] for i in perm[n_test : n_test + n_train]], [rows[i] for i in perm[:n_test]]


def download_command(hub_id: str, config: str | None) -> str:
    """The one command that puts hub dataset `hub_id` into the local cache `datasets` reads offline."""
    args = f"{hub_id!r}" + (f", {config!r}" if config else "")
    return f'HF_HUB_OFFLINE=0 python -c "import datasets; datasets.load_dataset({args})"'


def load_hub(hub_id: str, config: str | None, split: str) -> list[dict]:
    """The only place that calls `datasets.load_dataset` (network); tests set HUB_LOAD_DATASET. A dataset that
    cannot be loaded (offline and not cached, unknown, unreachable) is a DataError naming the download command."""
    fn = HUB_LOAD_DATASET
    if fn is None:
        from datasets import load_dataset as fn
    try:
        ds = fn(hub_id, config, split=split) if config else fn(hub_id, split=split)
    except (OSError, ValueError) as err:  # ConnectionError (offline, no cache), DatasetNotFoundError, ...
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no")
        raise DataError(
            f"hub dataset {hub_id}" + (f" ({config})" if config else "") + f" could not be loaded: "
            f"{type(err).__name__}: {str(err)[:300]}. "
            + ("HF_HUB_OFFLINE=1 and it is not in the local cache: " if offline else "")
            + f"download it once where there is network access, into the cache the jobs read (HF_HOME / "
            f"HF_DATASETS_CACHE): `{download_command(hub_id, config)}`; or point task.source (or "
            "task.train_file / task.test_file) in matrix.yaml at a local .jsonl/.parquet file"
        ) from err
    return Records(
        [dict(r) for r in ds],
        f"hub dataset {hub_id}" + (f" ({config}, {split})" if config else f" ({split})"),
    )


def is_local(source: str) -> bool:
    return (
        source.startswith(("/", ".", "~"))
        or os.path.exists(source)
        or source.endswith((".jsonl", ".json", ".parquet", ".gz"))
    )


def source_rows(spec, split: str, hub_id: str, config: str | None, hub_split: str) -> tuple[list[dict], bool]:
    """Rows for `split` and whether they are already that split (True) or the whole dataset (False).

    Order of precedence: spec.train_file/test_file, then spec.source (hub id, a file = the whole
    dataset, or a folder holding <split>.jsonl/.parquet), then the task's default hub id."""
    key = f"task.{split}_file"
    explicit = getattr(spec, f"{split}_file", "") if spec is not None else ""
    if explicit:
        return read_records(os.path.expanduser(explicit), key), True
    source = (spec.source if spec is not None else "") or ""
    if source and is_local(source):
        p = Path(os.path.expanduser(source))
        if p.is_dir():
            for ext in (".jsonl", ".parquet", ".json", ".jsonl.gz"):
                if (p / f"{split}{ext}").is_file():
                    return read_records(p / f"{split}{ext}", "task.source"), True
            raise FileNotFoundError(
                f"folder {str(p)!r} has no {split}.jsonl/.parquet/.json; fix `task.source` or set `{key}` in matrix.yaml"
            )
        return read_records(p, "task.source"), False
    return load_hub(source or hub_id, config if not source else config, hub_split), hub_split == split


def nonempty(problems: list[Problem], task: str, split: str) -> list[Problem]:
    """`problems`, or a ValueError naming the task, the split and the matrix.yaml keys to fix if it is empty."""
    if not problems:
        raise ValueError(
            f"task {task!r}: the {split} split is empty after loading; point `task.{split}_file` or "
            "`task.source` in matrix.yaml at a dataset with problems in it"
        )
    return problems


def cap(problems: list[Problem], spec, split: str) -> list[Problem]:
    """The first spec.train_size problems of the train split (0 or no spec: all); other splits unchanged."""
    if split == "train" and spec is not None and getattr(spec, "train_size", 0):
        return problems[: spec.train_size]
    return problems


def check_split(split: str) -> None:
    """Raise unless `split` is one a hub task loads ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
