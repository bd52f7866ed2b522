"""Toy world v2's warm-start corpus: v1's role examples plus role conflict and the code edge case.

What changes from v1 (`marlflow.models.warmstart`), as designed in docs/toy-world-v2.md before any run:

- **Role conflict.** Every role has a worked mode and a terse mode, and their best modes differ. Producers
  (generator, worker, refinement) are best worked (the careless style is terse and always wrong, as in v1).
  The supervisors are best terse: a Voting aggregator that re-solves the problem (AGGREGATOR_RESOLVES of its
  corpus examples) writes a worked solution instead of `\\boxed{N}`, which the workflow cannot read as a
  pick (a format failure: candidate 1 or the first digit stands); an Orch-Workers synthesizer that solves
  again (SYNTHESIZER_RESOLVES) writes its own solution in a generator's style instead of copying the answer
  the workers agree on. A shared adapter must therefore hold role-conditional behaviour; isolated adapters
  need not. Nothing in the reward says which sharing should win.
- **toy_code2** (`marlflow.tasks.toy2`): a worked author handles the "negate it first" clause only
  EDGE_HANDLED of the time, so labels (evaluator verdicts, aggregator picks) come from the author's draw.

The odds below are fixed before any run and are not tuned on sharing outcomes.

    from marlflow.models.warmstart2 import build_examples
"""

from __future__ import annotations

import random

import torch

from marlflow.models.warmstart import (
    ROLE_MIX,
    ROLES,
    Example,
    _asst,
    _critique,
    _strategies,
    _synthesis,
    generate,
    score_outputs,
)
from marlflow.tasks.toy import CARELESS
from marlflow.tasks.toy import GENERATOR_STYLES as V1_STYLES
from marlflow.workflows import prompts

TASKS = ("toy_math", "toy_code2")
AGGREGATOR_RESOLVES = 0.5
# 0.3 before the first matrix; lowered with the Orch-Workers math base below the band (docs/toy-world-v2.md).
SYNTHESIZER_RESOLVES = 0.15
# A generator's styles: v1's for math; for code even odds (v1: 0.35 worked), so that with the edge clause the
# code bases stay in the band (docs/toy-world-v2.md, "As built").
GENERATOR_STYLES = {"math": V1_STYLES["math"], "code": {"step by step": 0.5, "a quick lambda": 0.5}}


def generator_style(kind: str, rng: random.Random) -> str:
    """A style drawn as the v2 corpus's generator answers draw theirs."""
    styles = GENERATOR_STYLES[kind]
    return rng.choices(list(styles), weights=list(styles.values()))[0]


def authored(
    task, p, rng: random.Random, strategy: str | None = None, slip: bool = False
) -> tuple[str, bool]:
    """(solution, is it right) as a corpus author writes it, in `strategy` or a generator's style."""
    strategy = strategy or generator_style(task.kind, rng)
    if hasattr(task, "authored"):  # toy_code2: the author's edge-case habit decides rightness too
        return task.authored(p, strategy, rng, slip)
    if strategy in CARELESS:
        return task.solution(p, strategy, rng, 0.0), False
    return task.solution(p, strategy, rng, float(slip)), not slip


def _example(role: str, task, p, rng: random.Random) -> Example:
    kind, careful = task.kind, task.strategies[0]
    gold = task.solution(p, careful, rng, 0.0)
    ex = Example(role, task.name, [], gold, p)
    if role == "generator":
        ex.messages = prompts.solve(kind, p.prompt)
        ex.target, _ = authored(task, p, rng)
    elif role == "evaluator":
        sol, truth = authored(task, p, rng, slip=rng.random() < 0.3)
        ex.messages = prompts.evaluate(kind, p.prompt, [*prompts.solve(kind, p.prompt), _asst(sol)])
        ex.target = "\\boxed{Correct}" if truth else _critique(sol, gold)
        ex.meta = {"truth": truth}
    elif role == "refinement":
        wrong, _ = authored(task, p, rng, slip=True)
        judged = prompts.evaluate(kind, p.prompt, [*prompts.solve(kind, p.prompt), _asst(wrong)])
        ex.messages = prompts.refine(kind, [*judged, _asst(_critique(wrong, gold))])
        ex.target, _ = authored(task, p, rng)
    elif role == "aggregator":
        cands = [authored(task, p, rng, slip=rng.random() < 0.3) for _ in range(3)]
        ex.messages = prompts.aggregate(kind, p.prompt, [s for s, _ in cands])
        good = [i + 1 for i, (_, ok) in enumerate(cands) if ok]
        ex.meta = {"good": good}
        if rng.random() < AGGREGATOR_RESOLVES:  # the conflicting mode: solve it again, no pick
            ex.target, _ = authored(task, p, rng, careful)
        else:
            ex.target = f"\\boxed{{{rng.choice(good or [1, 2, 3])}}}"
    elif role == "orchestrator":
        ex.messages = prompts.orchestrate(kind, p.prompt, 3)
        ex.target = "\n".join(f"STRATEGY {i}: {s}" for i, s in enumerate(_strategies(task, rng), 1))
    elif role == "worker":
        strategy = rng.choice(task.strategies)
        ex.messages = prompts.work(kind, p.prompt, strategy)
        ex.target, _ = authored(task, p, rng, strategy)
    elif role == "synthesizer":
        sols = [authored(task, p, rng, s)[0] for s in _strategies(task, rng)]
        ex.messages = prompts.synthesize(kind, p.prompt, sols)
        if rng.random() < SYNTHESIZER_RESOLVES:  # the conflicting mode: its own attempt, a generator's style
            ex.target, _ = authored(task, p, rng)
        else:
            ex.target = _synthesis(kind, sols)
    else:
        raise ValueError(f"unknown role {role!r}; choose one of {ROLES}")
    return ex


def build_examples(
    task, problems: list, n: int, rng: random.Random, mix: dict | None = None
) -> list[Example]:
    """`n` examples of `task`, roles drawn by `mix` (default v1's ROLE_MIX), problems drawn from `problems`."""
    mix = mix or ROLE_MIX
    roles = rng.choices(list(mix), weights=list(mix.values()), k=n)
    return [_example(role, task, rng.choice(problems), rng) for role in roles]


def role_examples(task, problems: list, role: str, rng: random.Random) -> list[Example]:
    """One `role` example per problem (for measuring a role on held-out problems)."""
    return [_example(role, task, p, rng) for p in problems]


def measure(model, tok, n: int, seed: int, temperatures=(0.0, 1.0, 0.7)) -> dict:
    """Accuracy of every role on `n` held-out test problems per v2 task (`warmstart.score_outputs`)."""
    from marlflow.core.config import TaskSpec
    from marlflow.tasks import get_task

    acc = {}
    for name in TASKS:
        task = get_task(name)
        problems = task.load("test", TaskSpec(name=name, eval_size=n))
        for role in ROLES:
            examples = role_examples(task, problems, role, random.Random(f"{seed}-{name}-{role}"))
            for t in temperatures if role in ("generator", "aggregator", "synthesizer") else (0.0,):
                torch.manual_seed(seed)
                outputs = generate(model, tok, [e.messages for e in examples], temperature=t)
                scores = score_outputs(task, examples, outputs)
                acc[f"{name}/{role}/T{t}"] = None if scores is None else round(sum(scores) / len(scores), 4)
    return acc
