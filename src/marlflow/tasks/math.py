"""Math tasks (gsm8k, math, dapo_math): loaders for hub ids or local files, and trustworthy verifiers.

Answers are the content of the last `\\boxed{...}` (nested braces handled). GSM8K answers are compared
as numbers (commas, units, `$`, trailing `.0` handled); MATH and DAPO answers with math-verify. math-verify
normally times out with signal.alarm, which fails outside the main thread, so it runs here with its own
timeouts disabled inside helper processes that are killed and replaced when a check overruns
(`math_equal(pred, gold, timeout=...)` works from any thread or process).

    from marlflow.tasks import get_task
    task = get_task("math")                      # MATH train (12k) / MATH-500 test
    problems = task.load("test", TaskSpec(name="math", source="data/math"))
    task.score(problems, outputs)                 # [1.0, 0.0, ...]

This module also holds the data-loading helpers the code tasks reuse (`read_records`, `split_records`,
`load_hub`). `datasets.load_dataset` is called only in `load_hub`, and only through `HUB_LOAD_DATASET`
when that is set, which is how tests stand a local file in for a download.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math as _pymath
import os
import queue
import re
import selectors
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

from marlflow.tasks import Problem, register

HUB_LOAD_DATASET: Callable | None = None  # tests: a load_dataset-like function that reads local files

# --------------------------------------------------------------------------------------------------
# Data helpers (shared with marlflow.tasks.code)


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
            raise DataError(f"dataset file {str(p)!r} is not a readable parquet file ({type(err).__name__}: "
                            f"{str(err)[:200]}); fix `{key}` in matrix.yaml") from None  # fmt: skip
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
    n_test = _pymath.ceil(test_size * n) if isinstance(test_size, float) else int(test_size)
    n_train = _pymath.floor((1 - test_size) * n) if isinstance(test_size, float) else n - n_test
    return [rows[i] for i in perm[n_test : n_test + n_train]], [rows[i] for i in perm[:n_test]]


def load_hub(hub_id: str, config: str | None, split: str) -> list[dict]:
    """The only place that calls `datasets.load_dataset` (network); tests set HUB_LOAD_DATASET."""
    fn = HUB_LOAD_DATASET
    if fn is None:
        from datasets import load_dataset as fn
    ds = fn(hub_id, config, split=split) if config else fn(hub_id, split=split)
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


def _nonempty(problems: list[Problem], task: str, split: str) -> list[Problem]:
    if not problems:
        raise ValueError(
            f"task {task!r}: the {split} split is empty after loading; point `task.{split}_file` or "
            "`task.source` in matrix.yaml at a dataset with problems in it"
        )
    return problems


def _cap(problems: list[Problem], spec, split: str) -> list[Problem]:
    if split == "train" and spec is not None and getattr(spec, "train_size", 0):
        return problems[: spec.train_size]
    return problems


# --------------------------------------------------------------------------------------------------
# Answer extraction and checking


def last_boxed(text: str | None) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None if there is none."""
    if not text:
        return None
    starts = [m.start() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        i = text.index("{", start)
        depth = 0
        for j in range(i, len(text)):
            c = text[j]
            if c == "{" and text[j - 1] != "\\":
                depth += 1
            elif c == "}" and text[j - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j].strip()
        # unbalanced: try an earlier \boxed
    m = re.search(r"\\boxed ([^\s$]+)", text)  # "\boxed 5" form
    return m.group(1) if m else None


_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def parse_number(s: str | None) -> Fraction | None:
    """A single number in `s` ("1,000", "$18.00", "18 dollars", "\\$5", "50\\%", "\\frac{3}{4}", "-2.5"),
    as an exact Fraction; None if there is not exactly one number."""
    if s is None:
        return None
    t = s.strip().strip("$").replace("\\!", "").replace("\\,", "").replace("{,}", ",")
    t = re.sub(r"\\text\{[^{}]*\}|\\mbox\{[^{}]*\}|\\%|%|\\\$|\\dollar", " ", t)
    t = re.sub(r"\\([dt]?frac)(\d)(\d)", r"\\\1{\2}{\3}", t)  # \frac12 shorthand
    m = re.fullmatch(r"\s*(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}\s*", t)
    if m:
        return (
            Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
            if int(m.group(3))
            else None
        )
    m = re.fullmatch(r"\s*(-?\d+)\s*/\s*(\d+)\s*", t)
    if m:
        return Fraction(int(m.group(1)), int(m.group(2))) if int(m.group(2)) else None
    nums = _NUM.findall(t)
    if len(nums) != 1:
        return None
    n = nums[0].replace(",", "")
    try:
        return Fraction(n)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(pred: str | None, gold: str | None) -> bool:
    a, b = parse_number(pred), parse_number(gold)
    return a is not None and b is not None and a == b


class _VerifierProc:
    """One math-verify helper process: JSON lines in, JSON lines out."""

    def __init__(self):
        pkg_parent = str(Path(__file__).resolve().parents[2])
        boot = f"import sys; sys.path.insert(0, {pkg_parent!r}); from marlflow.tasks.math import _serve; _serve()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip

    def ask(self, pred: str, gold: str, timeout: float) -> bool | None:
        self.proc.stdin.write(json.dumps([pred, gold]) + "\n")
        self.proc.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
        sel.close()
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def close(self):
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()


_IDLE: queue.LifoQueue = queue.LifoQueue()
_LOCK = threading.Lock()
_ALL: list[_VerifierProc] = []


def _startup_budget(timeout: float) -> float:
    return timeout + 60.0  # the first call also pays for importing sympy in the helper


def math_equal(pred: str | None, gold: str | None, timeout: float = 5.0) -> bool:
    """True if `pred` and `gold` are the same mathematical answer (LaTeX or plain). Exact string or
    number matches are decided here; everything else goes to math-verify in a helper process that is
    killed after `timeout` seconds (then the answer counts as wrong). Safe in any thread."""
    if pred is None or gold is None:
        return False
    p, g = pred.strip(), gold.strip()
    if not p:
        return False
    if p == g:
        return True
    a, b = parse_number(p), parse_number(g)
    if a is not None and b is not None:
        return a == b
    try:
        proc = _IDLE.get_nowait()
        budget = timeout
    except queue.Empty:
        proc = _VerifierProc()
        with _LOCK:
            _ALL.append(proc)
        budget = _startup_budget(timeout)
    ans = proc.ask(p, g, budget)
    if ans is None:  # overran or died: kill it so the computation does not keep running
        proc.close()
        with _LOCK:
            _ALL.remove(proc)
        return False
    _IDLE.put(proc)
    return bool(ans)


def close_verifiers() -> None:
    with _LOCK:
        for p in _ALL:
            p.close()
        _ALL.clear()
    while not _IDLE.empty():
        _IDLE.get_nowait()


atexit.register(close_verifiers)


def _mv_equal(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    def P(s):
        return parse(s if "\\boxed" in s else f"\\boxed{{{s}}}", parsing_timeout=None)

    g, p = P(gold), P(pred)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=None))


def _serve() -> None:
    import logging

    logging.disable(logging.WARNING)  # math-verify warns on every call that its timeouts are off
    for line in sys.stdin:
        try:
            pred, gold = json.loads(line)
            ok = _mv_equal(pred, gold)
        except Exception:  # noqa: BLE001 - an unparsable answer is a wrong answer
            ok = False
        sys.stdout.write(json.dumps(ok) + "\n")
        sys.stdout.flush()


# --------------------------------------------------------------------------------------------------
# Tasks


def gsm8k_gold(answer: str) -> str:
    return answer.split("####")[-1].strip().replace(",", "")


class _MathTask:
    kind = "math"
    name = ""
    timeout = 5.0

    def extract(self, text: str) -> str | None:
        return last_boxed(text)

    def check(self, pred: str, gold: str) -> bool:
        return math_equal(pred, gold, timeout=self.timeout)

    def score(self, problems: Sequence[Problem], outputs: Sequence[str]) -> list[float]:
        if len(problems) != len(outputs):
            raise ValueError(f"{len(problems)} problems but {len(outputs)} outputs")
        preds = [self.extract(o) for o in outputs]
        # math-verify checks are independent; a few threads keep the helper processes busy.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, min(4, len(preds)))) as ex:
            oks = list(
                ex.map(lambda pg: pg[0] is not None and self.check(pg[0], pg[1].answer), zip(preds, problems))
            )
        return [1.0 if ok else 0.0 for ok in oks]


@register("gsm8k")
class GSM8K(_MathTask):
    """GSM8K (openai/gsm8k, config main): train 7,473 / test 1,319; gold = the number after ####."""

    name = "gsm8k"
    hub_id, hub_config = "openai/gsm8k", "main"

    def extract(self, text: str) -> str | None:
        b = last_boxed(text)
        if b is None and text and "####" in text:
            b = (
                text.rsplit("####", 1)[1].strip().splitlines()[0]
                if text.rsplit("####", 1)[1].strip()
                else None
            )
        return b

    def check(self, pred: str, gold: str) -> bool:
        if numbers_equal(pred, gold):
            return True
        return parse_number(pred) is None and math_equal(pred, gold, timeout=self.timeout)

    def load(self, split: str, spec=None) -> list[Problem]:
        _check_split(split)
        rows, _ = source_rows(spec, split, self.hub_id, self.hub_config, split)
        out = []
        for i in range(len(rows)):
            q, a = field(rows, i, "question"), str(field(rows, i, "answer", "answer"))
            out.append(Problem(f"gsm8k/{split}/{i}", "gsm8k", "math", q, gsm8k_gold(a), meta={"solution": a}))
        return _nonempty(_cap(out, spec, split), self.name, split)


@register("math")
class MATH(_MathTask):
    """Hendrycks MATH: train (PRM800K 12,000 locally) / test MATH-500. Gold = `answer`, else last boxed."""

    name = "math"
    # The hub has no PRM800K train split: the default train source is MATH's original 7,500 train problems.
    # The local data/math/train.jsonl (12,000 = PRM800K train) is what matrix.yaml should point to.
    hub_ids = {
        "train": ("DigitalLearningGmbH/MATH-lighteval", "default"),
        "test": ("HuggingFaceH4/MATH-500", None),
    }

    def load(self, split: str, spec=None) -> list[Problem]:
        _check_split(split)
        hub_id, cfg = self.hub_ids[split]
        rows, _ = source_rows(spec, split, hub_id, cfg, "test" if split == "test" else "train")
        out = []
        for i, r in enumerate(rows):
            problem = field(rows, i, "problem")
            gold = field(rows, i, "answer", "answer", required=False)
            if gold in (None, ""):
                gold = last_boxed(field(rows, i, "solution", required=False, default=""))
            if gold is None:
                continue
            uid = field(rows, i, "unique_id", "answer", required=False) or str(i)
            out.append(Problem(f"math/{uid}", "math", "math", problem, str(gold),
                               meta={k: r.get(k) for k in ("subject", "level")}))  # fmt: skip
        return _nonempty(_cap(out, spec, split), self.name, split)


@register("dapo_math")
class DAPOMath(_MathTask):
    """open-r1/DAPO-Math-17k-Processed, config `en`, split 90/10 with seed 42 (12,704 / 1,412)."""

    name = "dapo_math"
    hub_id, hub_config = "open-r1/DAPO-Math-17k-Processed", "en"

    def load(self, split: str, spec=None) -> list[Problem]:
        _check_split(split)
        rows, is_split = source_rows(spec, split, self.hub_id, self.hub_config, "train")
        # Checked before the split so that an error names the row of the file, not of a shuffled split.
        items = [
            (field(rows, i, "prompt"), str(field(rows, i, "solution", "answer"))) for i in range(len(rows))
        ]
        if not is_split:
            train, test = split_records(items, 0.1, seed=42)
            items = train if split == "train" else test
        out = [Problem(f"dapo_math/{split}/{i}", "dapo_math", "math", q, a) for i, (q, a) in enumerate(items)]
        return _nonempty(_cap(out, spec, split), self.name, split)


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
