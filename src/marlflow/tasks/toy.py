"""Toy tasks for the `toy` preset: chained integer arithmetic and tiny Python functions.

Both are generated from a seed (no files), small enough that a ~1M-parameter model learns them on a
CPU in minutes:

- toy_math: `8-5+7`, three terms in 1..9 with at least one minus sign; reward 1 if the last `\\boxed{}`
  equals the value. 2,187 problems, 433 held out.
- toy_code: "add 3, multiply by 2, subtract 5" (three steps, a multiplication after an addition or
  subtraction) -> a Python function `f`; reward 1 if it passes five asserts, run in the sandbox like any
  model-written code. 1,120 problems, 224 held out.

Train and test problems are disjoint (split by a hash of the problem text). The module also writes the
careful, careless and deliberately slipped solutions (`solution`) that `marlflow.models.warmstart` turns into the
warm-start corpus; see CARELESS for the behaviour RL is expected to learn.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections.abc import Sequence

from marlflow.tasks import Problem, register
from marlflow.tasks.code import CodeTask
from marlflow.tasks.math import last_boxed

MATH_STRATEGIES = ("left to right", "add all the numbers")
CODE_STRATEGIES = ("step by step", "a quick lambda")
_CODE_OPS = {"add": "+", "subtract": "-", "multiply by": "*"}
_TEST_XS = (0, 1, 2, 5, -3)
# The behaviour RL is meant to find at toy scale. The warm-start corpus, like text from careful and careless
# authors, has two kinds of solution: worked ones, and one common misconception per task (CARELESS): adding
# every number whatever its sign, or a one-line lambda that forgets operator precedence. Every problem of
# the toy spaces has a minus sign / a multiplication after an addition, so a careless solution is always
# wrong. The warm-started generator picks the careless style most of the time (GENERATOR_STYLES); choosing
# the worked style is a decision a few hundred rewarded episodes can teach (as with real models choosing
# to reason), whereas new arithmetic facts would take far more. Workers are told a strategy, so in
# Orch-Workers the same lever is the orchestrator's choice of strategies.
CARELESS = frozenset({"add all the numbers", "a quick lambda"})
GENERATOR_STYLES = {
    "math": {"left to right": 0.6, "add all the numbers": 0.4},
    "code": {"step by step": 0.35, "a quick lambda": 0.65},
}


def generator_style(kind: str, rng: random.Random) -> str:
    """A style drawn as the warm-start corpus's generator answers draw theirs."""
    styles = GENERATOR_STYLES[kind]
    return rng.choices(list(styles), weights=list(styles.values()))[0]


def _is_test(text: str) -> bool:
    # A fixed 20% of the problem space is held out; membership depends only on the text.
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % 5 == 0


def _generate(kind: str, split: str, n: int, space) -> list[Problem]:
    """The first `n` problems of `split`, from the whole problem space in a fixed shuffled order."""
    items = [
        (prompt, answer, tests) for prompt, answer, tests in space() if _is_test(prompt) == (split == "test")
    ]
    random.Random(f"toy_{kind}-{split}").shuffle(items)
    return [
        Problem(
            uid=f"toy_{kind}-{hashlib.sha256(p.encode()).hexdigest()[:10]}",
            task=f"toy_{kind}",
            kind=kind,
            prompt=p,
            answer=a,
            tests=t,
        )  # fmt: skip
        for p, a, t in items[:n]
    ]


# ---------------------------------------------------------------- toy_math


def _math_space():
    for a, b, c in itertools.product(range(1, 10), repeat=3):
        for s1, s2 in itertools.product("+-", repeat=2):
            if "-" not in s1 + s2:
                continue  # all-plus sums would make "add all the numbers" right
            prompt = f"{a}{s1}{b}{s2}{c}"
            yield prompt, str(eval(prompt)), ""  # noqa: S307 - our own generated arithmetic, not model output


def _math_terms(prompt: str) -> list[int]:
    return [int(t) for t in re.findall(r"[+-]?\d+", prompt)]


def math_solution(
    prompt: str, strategy: str = MATH_STRATEGIES[0], error_at: int | None = None, delta: int = 1
):
    """Gold (or deliberately wrong, if `error_at` is set) solution in the toy format; "add all the
    numbers" is the careless misconception (signs ignored), wrong on every toy_math problem."""
    terms = _math_terms(prompt)
    if strategy == "add all the numbers":
        return f"\\boxed{{{sum(abs(t) for t in terms) + (0 if error_at is None else delta)}}}"
    running, lines = terms[0], []
    for k, t in enumerate(terms[1:]):
        before = running
        running += t + (delta if error_at == k else 0)
        # Each step restates its operands ("8-8=0"), so every sum is local to the tokens before it.
        lines.append(f"{before}{t:+d}={running}")
    return ";".join(lines) + f";\\boxed{{{running}}}"


class ToyMath:
    name, kind = "toy_math", "math"
    strategies = MATH_STRATEGIES

    def load(self, split: str, spec) -> list[Problem]:
        n = spec.eval_size if split == "test" else (spec.train_size or 4000)
        return _generate("math", split, n, _math_space)

    def extract(self, text: str) -> str | None:
        return last_boxed(text)

    def careless(self, text: str) -> bool:
        """Is `text` in the careless style (a bare boxed answer, no worked steps)?"""
        return text.lstrip().startswith("\\boxed")

    def score(self, problems: Sequence[Problem], outputs: Sequence[str]) -> list[float]:
        return [float((self.extract(o) or "").strip() == p.answer) for p, o in zip(problems, outputs)]

    def solution(self, problem: Problem, strategy: str, rng: random.Random, p_wrong: float) -> str:
        """A solution in `strategy`, with a slip with probability `p_wrong` (CARELESS ones are wrong anyway)."""
        err = rng.randrange(len(_math_terms(problem.prompt)) - 1) if rng.random() < p_wrong else None
        return math_solution(problem.prompt, strategy, err, rng.choice((-2, -1, 1, 2)))


register("toy_math")(ToyMath)

# ---------------------------------------------------------------- toy_code


def _code_space():
    steps = [("add", k) for k in range(1, 6)] + [("subtract", k) for k in range(1, 6)]
    steps += [("multiply by", k) for k in range(2, 6)]
    for ops in itertools.product(steps, repeat=3):
        kinds = [op for op, _ in ops]
        if not any(
            k == "multiply by" and any(o != "multiply by" for o in kinds[:i]) for i, k in enumerate(kinds)
        ):
            continue  # without a multiplication after an addition, "a quick lambda" would be right
        prompt = ", ".join(f"{op} {k}" for op, k in ops)
        tests = "\n".join(f"assert f({x}) == {_apply(ops, x)}" for x in _TEST_XS)
        yield prompt, code_solution(prompt), tests


def _apply(ops, x: int) -> int:
    for op, k in ops:
        x = {"+": x + k, "-": x - k, "*": x * k}[_CODE_OPS[op]]
    return x


def _code_ops(prompt: str) -> list[tuple[str, int]]:
    return [(m.group(1), int(m.group(2))) for m in re.finditer(r"(add|subtract|multiply by) (\d+)", prompt)]


def code_solution(
    prompt: str, strategy: str = CODE_STRATEGIES[0], error_at: int | None = None, delta: int = 1
):
    """Gold (or wrong, if `error_at` is set: that step's constant is off by `delta`) function text; "a quick
    lambda" is the careless misconception (no parentheses), wrong on every toy_code problem."""
    ops = [
        (_CODE_OPS[op], k + (delta if i == error_at else 0)) for i, (op, k) in enumerate(_code_ops(prompt))
    ]
    if strategy == "step by step":
        body = "; ".join(f"x = x {s} {k}" for s, k in ops[:-1])
        last = f"return x {ops[-1][0]} {ops[-1][1]}"
        src = f"def f(x): {body}; {last}" if body else f"def f(x): {last}"
    else:  # "a quick lambda": one expression, no parentheses
        src = "f = lambda x: x" + "".join(f" {s} {k}" for s, k in ops)
    return f"```python\n{src}\n```"


class ToyCode(CodeTask):
    """Scored like every code task: the extracted program plus the asserts, in the sandbox."""

    name, kind = "toy_code", "code"
    strategies = CODE_STRATEGIES

    def load(self, split: str, spec) -> list[Problem]:
        n = spec.eval_size if split == "test" else (spec.train_size or 4000)
        return _generate("code", split, n, _code_space)

    def careless(self, text: str) -> bool:
        """Is `text` in the careless style (a lambda rather than step-by-step statements)?"""
        return "lambda" in text

    def solution(self, problem: Problem, strategy: str, rng: random.Random, p_wrong: float) -> str:
        """As ToyMath.solution: a function in `strategy`; a slip makes one step's constant off."""
        n = len(_code_ops(problem.prompt))
        err = rng.randrange(n) if rng.random() < p_wrong else None
        return code_solution(problem.prompt, strategy, err, rng.choice((-1, 1, 2)))


register("toy_code")(ToyCode)
