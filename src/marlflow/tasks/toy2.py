"""Toy world v2's code task, `toy_code2`: tiny Python functions with a precedence trap and an edge case.

The design and what it permits are in docs/toy-world-v2.md. A problem is v1's three steps ("add 3, multiply
by 2, subtract 5", a multiplication after an addition or subtraction), and on half the problems a first
clause "if x is negative, negate it first". The five asserts include x = -3, so a function that skips the
clause is wrong on those problems:

    toy_code2: "if x is negative, negate it first; add 3, multiply by 2, subtract 5" -> `f`, five asserts.
    2,240 problems, ~450 held out (split by a hash of the text, as every toy task).

Two levers, both in the warm-start corpus at fixed odds (`marlflow.models.warmstart2`): the careless style
(a one-line lambda: precedence and clause both ignored) against the worked style, and, within the worked
style, whether the author handles the clause (EDGE_HANDLED of the time). A model must learn both to solve
every problem; the second is rare in the corpus, which is where the headroom comes from.

toy_math is unchanged from v1 (`marlflow.tasks.toy`).
"""

from __future__ import annotations

import itertools
import random

from marlflow.tasks import Problem, register
from marlflow.tasks.code import CodeTask
from marlflow.tasks.toy import _CODE_OPS, _TEST_XS, CARELESS, CODE_STRATEGIES, _apply, _code_ops, _generate

EDGE = "if x is negative, negate it first"
# Share of the corpus's worked solutions that handle the clause where it is present (docs/toy-world-v2.md: 0.25
# before the first matrix, raised with the bases below the band; never tuned on sharing outcomes).
EDGE_HANDLED = 0.4


def _space():
    steps = [("add", k) for k in range(1, 6)] + [("subtract", k) for k in range(1, 6)]
    steps += [("multiply by", k) for k in range(2, 6)]
    for ops in itertools.product(steps, repeat=3):
        kinds = [op for op, _ in ops]
        if not any(
            k == "multiply by" and any(o != "multiply by" for o in kinds[:i]) for i, k in enumerate(kinds)
        ):
            continue  # without a multiplication after an addition, "a quick lambda" would be right
        body = ", ".join(f"{op} {k}" for op, k in ops)
        for edge in (False, True):
            prompt = f"{EDGE}; {body}" if edge else body
            tests = "\n".join(f"assert f({x}) == {_apply(ops, abs(x) if edge else x)}" for x in _TEST_XS)
            yield prompt, solution(prompt), tests


def solution(
    prompt: str,
    strategy: str = CODE_STRATEGIES[0],
    error_at: int | None = None,
    delta: int = 1,
    handle_edge: bool = True,
) -> str:
    """Gold function text (or wrong: `error_at` puts one step's constant off by `delta`; `handle_edge` False
    skips the clause). "a quick lambda" is the careless style: no parentheses, no clause, always wrong."""
    ops = [
        (_CODE_OPS[op], k + (delta if i == error_at else 0)) for i, (op, k) in enumerate(_code_ops(prompt))
    ]
    if strategy == CODE_STRATEGIES[0]:
        lines = (["x = abs(x)"] if handle_edge and prompt.startswith(EDGE) else []) + [
            f"x = x {s} {k}" for s, k in ops[:-1]
        ]
        src = "def f(x): " + "".join(f"{line}; " for line in lines) + f"return x {ops[-1][0]} {ops[-1][1]}"
    else:
        src = "f = lambda x: x" + "".join(f" {s} {k}" for s, k in ops)
    return f"```python\n{src}\n```"


def has_edge(problem: Problem) -> bool:
    return problem.prompt.startswith(EDGE)


class ToyCode2(CodeTask):
    """Scored like every code task: the extracted program plus the asserts, in the sandbox."""

    name, kind = "toy_code2", "code"
    strategies = CODE_STRATEGIES

    def load(self, split: str, spec) -> list[Problem]:
        n = spec.eval_size if split == "test" else (spec.train_size or 4000)
        return _generate("code2", split, n, _space)

    def careless(self, text: str) -> bool:
        """Is `text` in the careless style (a lambda rather than step-by-step statements)?"""
        return "lambda" in text

    def solution(self, problem: Problem, strategy: str, rng: random.Random, p_wrong: float) -> str:
        """A function in `strategy` that handles the clause; a slip makes one step's constant off."""
        n = len(_code_ops(problem.prompt))
        err = rng.randrange(n) if rng.random() < p_wrong else None
        return solution(problem.prompt, strategy, err, rng.choice((-1, 1, 2)))

    def authored(self, problem: Problem, strategy: str, rng: random.Random, slip: bool) -> tuple[str, bool]:
        """(text, is it right) as a corpus author writes it: a worked author handles the clause with
        probability EDGE_HANDLED; careless ones never do and are always wrong."""
        if strategy in CARELESS:
            return solution(problem.prompt, strategy), False
        handle = rng.random() < EDGE_HANDLED
        n = len(_code_ops(problem.prompt))
        err, delta = (rng.randrange(n), rng.choice((-1, 1, 2))) if slip else (None, 1)
        return solution(problem.prompt, strategy, err, delta, handle), not slip and (
            handle or not has_edge(problem)
        )


register("toy_code2")(ToyCode2)
