"""Code tasks: loaders (local files, hub path with a local stand-in) and acceptance of the reference
solutions in the real sandbox: every HumanEval canonical solution and every MBPP reference passes, and
every task fails when its solution is replaced by `pass`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marlflow import sandbox
from marlflow.core.config import TaskSpec
from marlflow.tasks import Problem, get_task
from marlflow.tasks import datasets as task_data
from marlflow.tasks.code import MBPP_SPLITS, extract_code
from marlflow.tasks.deepcoder_runtime import deepcoder_tests

DATA = Path(__file__).parent / "data"
HE = DATA / "humaneval" / "test.jsonl"
MBPP_FILE = DATA / "mbpp" / "mbpp.jsonl"
# Upstream defects: reference solutions that fail their own tests (none found in these files).
MBPP_KNOWN_BAD: set[str] = set()
HUMANEVAL_KNOWN_BAD: set[str] = set()


def test_extract_code():
    assert extract_code("text\n```python\na = 1\n```\nmore\n```py\nb = 2\n```\nend") == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1\n"
    assert extract_code("```python\nd = 4\n") == "d = 4\n"  # cut off before the closing fence
    assert extract_code("   ") is None


@pytest.mark.slow
def test_humaneval_canonical_solutions_pass_and_stubs_fail():
    task = get_task("humaneval")
    problems = task.load("test", TaskSpec(name="humaneval", test_file=str(HE)))
    assert len(problems) == 164 and problems[0].uid == "HumanEval/0"
    good = [
        f"```python\n{p.meta['prefix']}{json.loads(json.dumps(p.answer))[len(p.meta['prefix']) :]}```"
        for p in problems
    ]
    rewards = task.score(problems, good)
    failing = {p.uid for p, r in zip(problems, rewards) if r != 1.0}
    assert failing == HUMANEVAL_KNOWN_BAD
    # the body-only form (what a completion model writes) is accepted too
    assert task.score(problems[:3], [p.answer[len(p.meta["prefix"]) :] for p in problems[:3]]) == [1.0] * 3
    stubs = task.score(problems, ["    pass\n"] * len(problems))
    assert stubs == [0.0] * len(problems)
    assert task.score(problems[:2], ["no code here", ""]) == [0.0, 0.0]


@pytest.mark.slow
def test_mbpp_reference_solutions_pass_and_stubs_fail():
    task = get_task("mbpp")
    task.timeout = 60  # mbpp/123 (amicable numbers up to 9,999) needs ~5 CPU-seconds, more on a busy machine
    spec = TaskSpec(name="mbpp", source=str(MBPP_FILE))
    problems = task.load("train", spec) + task.load("test", spec)
    rows = [json.loads(x) for x in MBPP_FILE.read_text().splitlines()]
    extra = [r for r in rows if r["task_id"] < 11 or 511 <= r["task_id"] <= 600]
    problems += [Problem(f"mbpp/{r['task_id']}", "mbpp", "code", "", r["code"],
                                   tests=(r["test_setup_code"] + "\n" if r["test_setup_code"] else "") + "\n".join(r["test_list"]))
                 for r in extra]  # fmt: skip
    assert len(problems) == 974
    rewards = task.score(problems, [p.answer for p in problems])
    assert {p.uid for p, r in zip(problems, rewards) if r != 1.0} == MBPP_KNOWN_BAD
    assert task.score(problems, ["pass"] * len(problems)) == [0.0] * len(problems)


def test_mbpp_splits_from_one_file_and_from_hub():
    task = get_task("mbpp")
    spec = TaskSpec(name="mbpp", source=str(MBPP_FILE))
    test, train = task.load("test", spec), task.load("train", spec)
    assert (len(test), len(train)) == (500, 374)
    assert [p.meta["task_id"] for p in test][:2] == [11, 12] and train[-1].meta["task_id"] == 974
    assert "Your code should pass these tests" in test[0].prompt and "assert" in test[0].tests
    rows = [json.loads(x) for x in MBPP_FILE.read_text().splitlines()]
    calls = []

    def fake_load_dataset(hub_id, config=None, split=None):
        calls.append((hub_id, config, split))
        lo, hi = MBPP_SPLITS[split]
        return [r for r in rows if lo <= r["task_id"] <= hi]

    mp = pytest.MonkeyPatch()
    mp.setattr(task_data, "HUB_LOAD_DATASET", fake_load_dataset)
    try:
        hub_test = task.load("test", TaskSpec(name="mbpp"))
    finally:
        mp.undo()
    assert calls == [("google-research-datasets/mbpp", "full", "test")]
    assert [p.uid for p in hub_test] == [p.uid for p in test]
    assert (
        task.load("train", TaskSpec(name="mbpp", source=str(MBPP_FILE), train_size=10))[-1].meta["task_id"]
        == 610
    )


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*task\.test_file"):
        get_task("mbpp").load("test", TaskSpec(name="mbpp", test_file=str(tmp_path / "nope.jsonl")))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        get_task("humaneval").load(
            "test", TaskSpec(name="humaneval", test_file=str(tmp_path / "empty.jsonl"))
        )
    with pytest.raises(ValueError, match="only a test split"):
        get_task("humaneval").load("train", TaskSpec(name="humaneval", source=str(HE)))


def _deepcoder_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        if i % 3 == 0:
            tests = [{"type": "stdin_stdout", "input": f"{i} 1\n", "output": f"{i + 1}\n"},
                     {"type": "stdin_stdout", "input": "2 2\n", "output": "4\n"}]  # fmt: skip
            sol = "a, b = map(int, input().split())\nprint(a + b)\n"
        elif i % 3 == 1:
            tests = [{"type": "function_call", "fn_name": "add", "input": [i, 1], "output": [i + 1]},
                     {"type": "function_call", "fn_name": "add", "input": [2, 2], "output": [4]}]  # fmt: skip
            sol = "def add(a, b):\n    return a + b\n"
        else:
            tests, sol = [], "pass"  # no tests: must be filtered out
        rows.append({"problem": f"Add two numbers ({i}).", "tests": json.dumps(tests), "solutions": [sol]})
    return rows


def test_deepcoder_split_filter_and_verification(tmp_path):
    import pandas as pd

    rows = _deepcoder_rows(1530)  # 1,020 with tests -> 1,000 test + 20 train
    path = tmp_path / "deepcoder.parquet"
    pd.DataFrame(rows).to_parquet(path)
    task = get_task("deepcoder")
    spec = TaskSpec(name="deepcoder", source=str(path))
    train, test = task.load("train", spec), task.load("test", spec)
    assert (len(train), len(test)) == (20, 1000)
    assert not {p.uid for p in train} & {p.uid for p in test}
    assert task.load("train", spec) == train  # deterministic
    # same shuffle as datasets' Dataset.shuffle(seed=42)
    import datasets

    with_tests = [r for r in rows if json.loads(r["tests"])]
    ds = datasets.Dataset.from_list([{"problem": r["problem"]} for r in with_tests]).shuffle(seed=42)
    assert [p.prompt for p in test[:20]] == ds["problem"][:20]
    sample = train[:6]
    assert task.score(sample, [f"```python\n{p.answer}```" for p in sample]) == [1.0] * 6
    wrong = [p.answer.replace("a + b", "a - b") for p in sample]
    assert task.score(sample, wrong) == [0.0] * 6
    assert task.score(sample, ["pass"] * 6) == [0.0] * 6


def test_deepcoder_hub_path_and_test_encoding():
    rows = _deepcoder_rows(30)
    seen = []

    def fake(hub_id, config=None, split=None):
        seen.append((hub_id, config, split))
        return rows

    mp = pytest.MonkeyPatch()
    mp.setattr(task_data, "HUB_LOAD_DATASET", fake)
    try:
        task = get_task("deepcoder")
        task.test_count = 5
        test = task.load("test", TaskSpec(name="deepcoder"))
    finally:
        mp.undo()
    assert seen == [("agentica-org/DeepCoder-Preview-Dataset", "primeintellect", "train")] and len(test) == 5
    assert deepcoder_tests("[]") == ""
    assert deepcoder_tests({"inputs": ["1\n"], "outputs": ["1\n"]}).startswith(sandbox.STDIO_MARKER)
    enc = deepcoder_tests(
        [{"type": "function_call", "fn_name": "f", "input": "[[1, 2]]", "output": "[[2, 1]]"}]
    )
    assert sandbox.verify("def f(xs):\n    return tuple(reversed(xs))\n", enc).passed
    assert sandbox.verify("class Solution:\n    def f(self, xs):\n        return xs[::-1]\n", enc).passed
    assert not sandbox.verify("def f(xs):\n    return xs\n", enc).passed
