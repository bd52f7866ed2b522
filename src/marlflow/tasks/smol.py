"""Tasks for the `smol` preset: problems SmolLM2-135M-Instruct solves sometimes, so RL has room to learn.

docs/environment.md section 11 measured the untrained model on candidate tasks; these two sit in the
useful middle (GSM8K, chained arithmetic and MBPP are near zero at base):

- smol_math: small-table multiplication, "What is 7 times 8?" with a, b in 2..12 (base accuracy about
  0.37 greedy). The model rarely writes `\\boxed{}`, so the reward reads the last `\\boxed{}` if there
  is one and otherwise the last number in the output, compared as an integer.
- smol_code: very easy linear functions, "Write a Python function f(x) that returns x times 3 plus 1"
  (about 0.70 greedy, 0.40 at T=0.7); reward 1 if the extracted code passes five asserts in the sandbox.

Both problem spaces are small and enumerated, not sampled: every problem appears once per split, in a
fixed shuffled order, and `load` returns at most `eval_size` (test) or `train_size` (train, 0 = all) of
them. The split is a hash of the problem's identity (`tasks.toy._is_test`); for multiplication the
identity is the unordered pair, so "7 times 8" and "8 times 7" always land in the same split.

    from marlflow.core.config import TaskSpec
    from marlflow.tasks import get_task
    task = get_task("smol_math")
    problems = task.load("test", TaskSpec(name="smol_math", eval_size=32))
    task.score(problems[:1], ["7 times 8 is 56."])   # -> [1.0] if problems[0] is 7*8
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence

from marlflow.tasks import Problem, register
from marlflow.tasks.code import CodeTask
from marlflow.tasks.math import last_boxed
from marlflow.tasks.toy import _is_test

MATH_RANGE = range(2, 13)  # the 2..12 times table
CODE_FACTORS = range(2, 10)
CODE_OFFSETS = range(1, 10)
_TEST_XS = (0, 1, 2, 5, -3)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _split(name: str, kind: str, split: str, items: list[tuple[str, str, str, str]]) -> list[Problem]:
    """Problems of `split` from (identity, prompt, answer, tests) tuples, in a fixed shuffled order."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    chosen = [it for it in items if _is_test(it[0]) == (split == "test")]
    # Shuffled once with a fixed seed so that a truncated eval set still mixes easy and hard problems.
    random.Random(f"{name}-{split}").shuffle(chosen)
    return [
        Problem(
            uid=f"{name}-{hashlib.sha256(prompt.encode()).hexdigest()[:10]}",
            task=name,
            kind=kind,
            prompt=prompt,
            answer=answer,
            tests=tests,
        )
        for _, prompt, answer, tests in chosen
    ]


def _cap(problems: list[Problem], split: str, spec) -> list[Problem]:
    n = spec.eval_size if split == "test" else spec.train_size
    return problems[:n] if n else problems


# ---------------------------------------------------------------- smol_math


def parse_int(text: str | None) -> int | None:
    """The last number in `text` as an integer ("1,024" -> 1024, "56.0" -> 56); None if there is none
    or it is not a whole number."""
    if not text:
        return None
    nums = _NUMBER.findall(text)
    if not nums:
        return None
    try:
        value = float(nums[-1].replace(",", ""))
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


class SmolMath:
    name, kind = "smol_math", "math"

    def load(self, split: str, spec) -> list[Problem]:
        items = [
            (f"{min(a, b)}*{max(a, b)}", f"What is {a} times {b}?", str(a * b), "")
            for a in MATH_RANGE
            for b in MATH_RANGE
        ]
        return _cap(_split(self.name, self.kind, split, items), split, spec)

    def extract(self, text: str) -> str | None:
        # SmolLM2 rarely writes \boxed{} (0-4% of answers, docs/environment.md section 11): fall back to
        # the last number in the whole output.
        boxed = last_boxed(text)
        value = parse_int(boxed) if boxed is not None else parse_int(text)
        return None if value is None else str(value)

    def score(self, problems: Sequence[Problem], outputs: Sequence[str]) -> list[float]:
        return [float(self.extract(o) == p.answer) for p, o in zip(problems, outputs)]


register("smol_math")(SmolMath)

# ---------------------------------------------------------------- smol_code


def _code_items() -> list[tuple[str, str, str, str]]:
    items = []
    for a in CODE_FACTORS:
        for b in CODE_OFFSETS:
            for word, sign in (("plus", 1), ("minus", -1)):
                prompt = f"Write a Python function f(x) that returns x times {a} {word} {b}."
                tests = "\n".join(f"assert f({x}) == {a * x + sign * b}" for x in _TEST_XS)
                gold = f"```python\ndef f(x):\n    return x * {a} {'+' if sign > 0 else '-'} {b}\n```"
                items.append((prompt, prompt, gold, tests))
    return items


class SmolCode(CodeTask):
    """Scored like every code task: the extracted program plus the asserts, in the sandbox."""

    name, kind = "smol_code", "code"

    def load(self, split: str, spec) -> list[Problem]:
        problems = _split(self.name, self.kind, split, _code_items())
        # The function name is fixed by the prompt; HumanEval-style callers read entry_point.
        return [Problem(**{**p.__dict__, "entry_point": "f"}) for p in _cap(problems, split, spec)]


register("smol_code")(SmolCode)
