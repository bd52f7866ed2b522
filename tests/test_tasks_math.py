"""Math tasks: \\boxed extraction, GSM8K numeric checks, math-verify equivalence (with timeouts that work
in threads), loaders for local files and the hub path with a local stand-in for the download."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from marlflow.core.config import TaskSpec
from marlflow.tasks import datasets as task_data
from marlflow.tasks import get_task
from marlflow.tasks.math import last_boxed, math_equal, parse_number

DATA = Path(__file__).parent / "data"


def test_last_boxed():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{a}{b^{2}}}.") == r"\frac{a}{b^{2}}"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"answer \boxed 5") == "5"
    assert last_boxed(r"\boxed{12} and an unclosed \boxed{3") == "12"
    assert last_boxed("no box here") is None and last_boxed("") is None and last_boxed(None) is None


def test_parse_number():
    assert parse_number("1,000") == 1000 and parse_number("$18.00") == 18 and parse_number("18 dollars") == 18
    assert (
        parse_number(r"\$5") == 5
        and parse_number(r"50\%") == 50
        and parse_number(r"\frac{3}{4}") == parse_number("0.75")
    )
    assert (
        parse_number("-2.5") == parse_number("-5/2")
        and parse_number("1 or 2") is None
        and parse_number("x") is None
    )


def _gsm8k(split: str):
    return get_task("gsm8k").load(split, TaskSpec(name="gsm8k", source=str(DATA / "gsm8k")))


def test_gsm8k_gold_and_variants_verify():
    task = get_task("gsm8k")
    problems = _gsm8k("test")
    assert len(problems) == 50 and len(_gsm8k("train")) == 20
    assert problems[0].answer == "18" and "Janet" in problems[0].prompt
    assert task.score(problems, [rf"So the answer is \boxed{{{p.answer}}}." for p in problems]) == [1.0] * 50
    variants = []
    for p in problems:
        n = int(p.answer)
        variants += [rf"\boxed{{{n:,}}}", rf"\boxed{{{n}.0}}", rf"\boxed{{\${n}}}", rf"\boxed{{{n} \text{{ dollars}}}}",
                     f"The total is {n}.\n#### {n}"]  # fmt: skip
    assert task.score([p for p in problems for _ in range(5)], variants) == [1.0] * len(variants)


def test_gsm8k_near_misses_rejected():
    task = get_task("gsm8k")
    problems = _gsm8k("test")
    misses = []
    for p in problems:
        n = int(p.answer)
        misses += [rf"\boxed{{{n + 1}}}", rf"\boxed{{{n * 10}}}", rf"\boxed{{{-n if n else 1}}}", rf"\boxed{{{n}.5}}",
                   rf"\boxed{{{n} or {n + 1}}}", f"{n}"]  # fmt: skip
    assert task.score([p for p in problems for _ in range(6)], misses) == [0.0] * len(misses)


def _bump_first_digit(s: str) -> str | None:
    m = re.search(r"\d", s)
    return None if m is None else s[: m.start()] + str((int(m.group()) + 1) % 10) + s[m.end() :]


def test_math500_gold_verifies_against_itself_and_its_solution():
    task = get_task("math")
    problems = task.load("test", TaskSpec(name="math", source=str(DATA / "math")))
    assert len(problems) == 50 and problems[0].uid == "math/test/precalculus/807.json"
    assert task.score(problems, [rf"\boxed{{{p.answer}}}" for p in problems]) == [1.0] * 50
    solutions = [json.loads(x)["solution"] for x in (DATA / "math" / "test.jsonl").read_text().splitlines()]
    assert task.score(problems, solutions) == [1.0] * 50
    misses = [(p, _bump_first_digit(p.answer)) for p in problems if _bump_first_digit(p.answer)]
    assert len(misses) > 40
    assert task.score([p for p, _ in misses], [rf"\boxed{{{m}}}" for _, m in misses]) == [0.0] * len(misses)


@pytest.mark.parametrize(
    "pred, gold",
    [
        (r"\frac{1}{2}", "0.5"),
        ("0.5", r"\dfrac{1}{2}"),
        ("1/2", r"\frac12"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3, \pi/2)"),
        (r"2\sqrt{2}", r"\sqrt{8}"),
        ("x^2+2x+1", "(x+1)^2"),
        (r"75\%", "75"),
        ("10", "10.0"),
        (r"[-2, 3)", r"[-2,3)"),
    ],
)
def test_equivalent_forms(pred, gold):
    assert math_equal(pred, gold)


@pytest.mark.parametrize(
    "pred, gold",
    [(r"\frac{1}{3}", "0.33"), (r"\sqrt{2}", "1.41"), ("(3, \\pi)", r"\left( 3, \frac{\pi}{2} \right)"),
     ("x^2+1", "(x+1)^2"), ("[-2, 3]", "[-2,3)"), ("", "1"), ("2", "-2"), ("12", "21")],
)  # fmt: skip
def test_near_misses(pred, gold):
    assert not math_equal(pred, gold)


def test_math_equal_times_out_inside_threads():
    assert math_equal(r"\frac{2}{4}", "0.5")  # warm a helper process
    results = {}

    def run():
        t0 = time.perf_counter()
        results["ok"] = math_equal(
            r"9^{9^{9^{9}}} - 9^{9^{9^{9}}}", r"\sqrt{2}^{\sqrt{2}^{99999}}", timeout=1.0
        )
        results["dt"] = time.perf_counter() - t0

    th = threading.Thread(target=run)
    th.start()
    th.join(90)
    assert results.get("ok") is False
    assert results["dt"] < 30
    with ThreadPoolExecutor(4) as ex:
        assert list(ex.map(lambda g: math_equal(rf"\frac{{{g * 2}}}{{2}}", str(g)), range(8))) == [True] * 8


def test_dapo_split_matches_datasets_train_test_split(tmp_path):
    import datasets

    rows = [{"prompt": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(200)]
    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = get_task("dapo_math")
    spec = TaskSpec(name="dapo_math", source=str(path))
    train, test = task.load("train", spec), task.load("test", spec)
    assert (len(train), len(test)) == (180, 20)
    ref = datasets.Dataset.from_list(rows).train_test_split(test_size=0.1, seed=42)
    assert [p.prompt for p in train] == ref["train"]["prompt"] and [p.prompt for p in test] == ref["test"][
        "prompt"
    ]
    assert task.score(test, [rf"\boxed{{{p.answer}}}" for p in test]) == [1.0] * 20
    seen = []

    def fake(hub_id, config=None, split=None):
        seen.append((hub_id, config, split))
        return rows

    mp = pytest.MonkeyPatch()
    mp.setattr(task_data, "HUB_LOAD_DATASET", fake)
    try:
        hub_test = task.load("test", TaskSpec(name="dapo_math"))
    finally:
        mp.undo()
    assert seen == [("open-r1/DAPO-Math-17k-Processed", "en", "train")]
    assert [p.prompt for p in hub_test] == [p.prompt for p in test]


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl.*task\.train_file"):
        get_task("gsm8k").load("train", TaskSpec(name="gsm8k", train_file=str(tmp_path / "missing.jsonl")))
    with pytest.raises(FileNotFoundError, match="task.source"):
        get_task("math").load("test", TaskSpec(name="math", source=str(tmp_path)))
    (tmp_path / "test.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        get_task("math").load("test", TaskSpec(name="math", source=str(tmp_path)))
    with pytest.raises(ValueError, match="split"):
        get_task("gsm8k").load("validation", TaskSpec(name="gsm8k"))


def test_hub_path_for_gsm8k_and_parquet(tmp_path):
    import pandas as pd

    rows = [json.loads(x) for x in (DATA / "gsm8k" / "test.jsonl").read_text().splitlines()]
    pd.DataFrame(rows).to_parquet(tmp_path / "test.parquet")
    seen = []

    def fake(hub_id, config=None, split=None):
        seen.append((hub_id, config, split))
        return pd.read_parquet(tmp_path / f"{split}.parquet").to_dict("records")

    mp = pytest.MonkeyPatch()
    mp.setattr(task_data, "HUB_LOAD_DATASET", fake)
    try:
        hub = get_task("gsm8k").load("test", TaskSpec(name="gsm8k"))
    finally:
        mp.undo()
    local = get_task("gsm8k").load("test", TaskSpec(name="gsm8k", test_file=str(tmp_path / "test.parquet")))
    assert seen == [("openai/gsm8k", "main", "test")]
    assert (
        [(p.uid, p.answer) for p in hub]
        == [(p.uid, p.answer) for p in local]
        == [(p.uid, p.answer) for p in _gsm8k("test")]
    )
