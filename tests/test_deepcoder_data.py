"""DeepCoder loading as the paper's code release does it (docs/paper-setup.md section 4), on the 12-problem
fixture in tests/data/deepcoder: runtime-results filtering, dropping, the seed-42 split, the results-file
builder (real sandbox), and the errors a wrong results file gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marlflow.core.config import TaskSpec
from marlflow.tasks import get_task
from marlflow.tasks.datasets import DataError

DATA = Path(__file__).resolve().parent / "data" / "deepcoder"
ROWS_FILE = DATA / "primeintellect.jsonl"
RESULTS_FILE = DATA / "runtime_results.json"
ROWS = [json.loads(line) for line in ROWS_FILE.read_text().splitlines()]
# Tests each row keeps after filtering (row 7 fails all and is dropped; row 9 has no results, keeps all).
KEPT = {0: 3, 1: 2, 2: 3, 3: 2, 4: 3, 5: 2, 6: 3, 8: 4, 9: 2, 10: 3, 11: 2}


def spec(**kw) -> TaskSpec:
    return TaskSpec(name="deepcoder", source=str(ROWS_FILE), test_size=4, eval_size=4, **kw)


def load_all(s: TaskSpec):
    task = get_task("deepcoder")
    return task.load("train", s), task.load("test", s)


def test_fixture_has_the_hub_schema_and_a_mix_of_tests():
    assert len(ROWS) == 12
    kinds = set()
    for r in ROWS:
        assert set(r) == {"problem", "solutions", "tests", "metadata"}
        assert isinstance(r["tests"], str)  # a JSON string, as on the hub
        kinds |= {t["type"] for t in json.loads(r["tests"])}
    assert kinds == {"stdin_stdout", "function_call"}


def test_without_results_every_problem_keeps_every_test():
    train, test = load_all(spec())
    assert len(test) == 4 and len(train) == 8
    rows = sorted(p.meta["row"] for p in train + test)
    assert rows == list(range(12))
    for p in train + test:
        assert p.meta["tests"] == len(json.loads(ROWS[p.meta["row"]]["tests"]))


def test_with_results_failed_tests_are_dropped_and_empty_problems_go():
    train, test = load_all(spec(runtime_results=str(RESULTS_FILE)))
    assert len(test) == 4 and len(train) == 7
    assert {p.meta["row"]: p.meta["tests"] for p in train + test} == KEPT
    assert {p.uid for p in train}.isdisjoint({p.uid for p in test})


def test_split_is_the_datasets_shuffle_with_seed_42():
    """The split is `Dataset.shuffle(seed=42)` of the kept problems, first test_size = test, as in the
    code release: checked against the real `datasets` library."""
    datasets = pytest.importorskip("datasets")
    train, test = load_all(spec(runtime_results=str(RESULTS_FILE)))
    kept = sorted(KEPT)
    shuffled = datasets.Dataset.from_list([{"row": r} for r in kept]).shuffle(seed=42)["row"]
    assert [p.meta["row"] for p in test] == shuffled[:4]
    assert [p.meta["row"] for p in train] == shuffled[4:]


def test_filtering_changes_the_reward_of_the_reference_solution():
    """Rows 1, 3 and 11 have one wrong expected output: their reference solution scores 0 on the
    unfiltered tests and 1 on the filtered ones (real sandbox)."""
    task = get_task("deepcoder")
    by_row = {}
    for s in (spec(), spec(runtime_results=str(RESULTS_FILE))):
        probs = {p.meta["row"]: p for split in ("train", "test") for p in task.load(split, s)}
        chosen = [probs[r] for r in (0, 1, 3, 11)]
        answers = [f"```python\n{p.answer}```" for p in chosen]
        by_row[bool(s.runtime_results)] = task.score(chosen, answers)
    assert by_row[False] == [1.0, 0.0, 0.0, 0.0]
    assert by_row[True] == [1.0, 1.0, 1.0, 1.0]


def _builder(out: Path, source: Path = ROWS_FILE) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "marlflow.tasks.deepcoder_runtime",
        "--source",
        str(source),
        "--out",
        str(out),
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )


def test_results_builder_reproduces_the_fixture_and_resumes(tmp_path):
    out = tmp_path / "runtime_results.json"
    first = _builder(out)
    assert first.returncode == 0, first.stderr[-2000:]
    assert json.loads(out.read_text()) == json.loads(RESULTS_FILE.read_text())
    assert json.loads(first.stdout) == {"problems": 11, "tests": 32, "passed": 27, "out": str(out)}
    again = _builder(out)  # everything cached: nothing is run again
    assert again.returncode == 0 and "0 problems to check (11 cached)" in again.stderr
    other = tmp_path / "other.jsonl"
    other.write_text(ROWS_FILE.read_text().replace("print(a + b)", "print(a - b)"))
    stale = _builder(out, other)
    assert stale.returncode == 1 and "was made for another dataset" in stale.stderr
    assert "Traceback" not in stale.stderr


@pytest.mark.parametrize(
    ("results", "match"),
    [
        ({"12": {"0": {"status": "passed"}}}, "key '12' is not a problem index 0..11"),
        ({"0": {"3": {"status": "passed"}}}, "problem 0 has test key '3', but that problem has 3 tests"),
        ({"0": {"0": {"verdict": "passed"}}}, 'problem 0 test 0 needs {"status": "..."}'),
        ({"0": ["passed"]}, "problem 0 must map test indices to results"),
        ([], "must be a JSON object"),
    ],
)
def test_wrong_results_file_is_refused(tmp_path, results, match):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    with pytest.raises(DataError, match=match.replace("(", r"\(").replace("{", r"\{").replace(".", r"\.")):
        get_task("deepcoder").load("train", spec(runtime_results=str(path)))


def test_results_file_missing_or_with_split_files(tmp_path):
    task = get_task("deepcoder")
    with pytest.raises(FileNotFoundError, match="python -m marlflow.tasks.deepcoder_runtime"):
        task.load("train", spec(runtime_results=str(tmp_path / "nope.json")))
    s = TaskSpec(name="deepcoder", train_file=str(ROWS_FILE), test_file=str(ROWS_FILE),
                 runtime_results=str(RESULTS_FILE))  # fmt: skip
    with pytest.raises(DataError, match="indexes the whole primeintellect train split"):
        task.load("train", s)
