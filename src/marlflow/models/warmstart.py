"""Synthetic warm-start corpus for the toy model: one supervised example per role call.

Every example is the exact chat messages a workflow role sees (built with `marlflow.workflows.prompts`)
plus the gold assistant reply, made from toy-task problems and their gold or deliberately wrong
solutions (`task.solution`). `marlflow.models.loading build-toy` trains on examples built from train problems
and measures each role on examples built from test problems with `score_outputs`.

    from marlflow.models.warmstart import build_examples
    examples = build_examples(get_task("toy_math"), problems, n=1000, rng=random.Random(0))
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field

import torch

from marlflow.tasks.math import last_boxed
from marlflow.tasks.toy import CARELESS, generator_style
from marlflow.workflows import prompts

ROLES = ("generator", "evaluator", "refinement", "aggregator", "orchestrator", "worker", "synthesizer")
# Share of examples per role. Generator-like roles dominate because they carry the task skill (and the
# RL signal); the judging roles only need their output format plus a better-than-chance instinct.
ROLE_MIX = {
    "generator": 5.0,
    "worker": 2.0,
    "refinement": 1.0,
    "evaluator": 1.0,
    "aggregator": 0.7,
    "orchestrator": 1.0,
    "synthesizer": 6.0,
}
_STRATEGY_RE = re.compile(r"^STRATEGY (\d+): (.+)$", re.M)


@dataclass
class Example:
    role: str
    task: str
    messages: list[dict]
    target: str
    problem: object = None  # marlflow.tasks.Problem whose answer the output is scored against
    meta: dict = field(default_factory=dict)  # what the role-specific check needs (truth, good picks)


def _authored(task, p, rng, strategy: str | None = None, slip: bool = False) -> tuple[str, bool]:
    """(solution, is it correct): in `strategy`, or in a generator's style; careless styles are always wrong."""
    strategy = strategy or generator_style(task.kind, rng)
    if strategy in CARELESS:
        return task.solution(p, strategy, rng, 0.0), False  # a slip on top could land on the right answer
    return task.solution(p, strategy, rng, float(slip)), not slip


def _critique(wrong: str, gold: str) -> str:
    # Name the first step that differs: the toy formats separate steps with ';'.
    if wrong.count(";") == gold.count(";"):
        for i, (a, b) in enumerate(zip(wrong.split(";"), gold.split(";")), 1):
            if a != b:
                return f"\\boxed{{Incorrect}} Step {i} is wrong."
    return "\\boxed{Incorrect} The result is wrong."


def _example(role: str, task, p, rng: random.Random) -> Example:
    kind, careful = task.kind, task.strategies[0]
    gold = task.solution(p, careful, rng, 0.0)
    ex = Example(role, task.name, [], gold, p)
    if role == "generator":
        ex.messages = prompts.solve(kind, p.prompt)
        ex.target, _ = _authored(task, p, rng)  # mostly careless: see tasks.toy.CARELESS
    elif role == "evaluator":
        sol, truth = _authored(task, p, rng, slip=rng.random() < 0.3)
        ex.messages = prompts.evaluate(kind, p.prompt, [*prompts.solve(kind, p.prompt), _asst(sol)])
        ex.target = "\\boxed{Correct}" if truth else _critique(sol, gold)
        ex.meta = {"truth": truth}
    elif role == "refinement":
        wrong, _ = _authored(task, p, rng, slip=True)
        judged = prompts.evaluate(kind, p.prompt, [*prompts.solve(kind, p.prompt), _asst(wrong)])
        ex.messages = prompts.refine(kind, [*judged, _asst(_critique(wrong, gold))])
        ex.target, _ = _authored(task, p, rng)  # another attempt, in the generator's usual styles
    elif role == "aggregator":
        cands = [_authored(task, p, rng, slip=rng.random() < 0.3) for _ in range(3)]
        ex.messages = prompts.aggregate(kind, p.prompt, [s for s, _ in cands])
        good = [i + 1 for i, (_, ok) in enumerate(cands) if ok]
        ex.target = f"\\boxed{{{rng.choice(good or [1, 2, 3])}}}"
        ex.meta = {"good": good}
    elif role == "orchestrator":
        ex.messages = prompts.orchestrate(kind, p.prompt, 3)
        ex.target = "\n".join(f"STRATEGY {i}: {s}" for i, s in enumerate(_strategies(task, rng), 1))
    elif role == "worker":
        strategy = rng.choice(task.strategies)
        ex.messages = prompts.work(kind, p.prompt, strategy)
        ex.target, _ = _authored(task, p, rng, strategy)
    elif role == "synthesizer":
        sols = [_authored(task, p, rng, s)[0] for s in _strategies(task, rng)]
        ex.messages = prompts.synthesize(kind, p.prompt, sols)
        ex.target = _synthesis(kind, sols)
    else:
        raise ValueError(f"unknown role {role!r}; choose one of {ROLES}")
    return ex


def _strategies(task, rng: random.Random) -> list[str]:
    # An orchestrator of the corpus lists all or all but one of the task's strategies, in random order.
    n = len(task.strategies)
    return rng.sample(list(task.strategies), n if rng.random() < 0.7 else max(1, n - 1))


def _asst(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _synthesis(kind: str, sols: list[str]) -> str:
    # Agreement means confidence: a candidate whose answer another shares, else the first candidate, copied
    # whole. Naive on purpose, so the order of the orchestrator's strategies matters and RL can improve it.
    # Measured: with ROLE_MIX synthesizer 3.0 the toy model learned this copy for code (greedy synthesizer
    # accuracy ~0.5 of a possible ~0.5) but hardly for math (~0.1), and orch_workers math started at 0.08;
    # at 6.0 math reaches 0.22 and the workflow starts at 0.285. A copy-the-last target gave 0.055, and a
    # solve-it-yourself target an orch_workers math base of 0.02.
    key = (lambda s: last_boxed(s)) if kind == "math" else (lambda s: s)
    (top, count), *_ = Counter(key(s) for s in sols).most_common(1)
    return next(s for s in sols if key(s) == top) if count >= 2 else sols[0]


def build_examples(
    task, problems: list, n: int, rng: random.Random, mix: dict | None = None
) -> list[Example]:
    """`n` examples of `task`, roles drawn by `mix` (default ROLE_MIX), problems drawn from `problems`."""
    mix = mix or ROLE_MIX
    roles = rng.choices(list(mix), weights=list(mix.values()), k=n)
    return [_example(role, task, rng.choice(problems), rng) for role in roles]


def role_examples(task, problems: list, role: str, rng: random.Random) -> list[Example]:
    """One `role` example per problem (for measuring a role on held-out problems)."""
    return [_example(role, task, p, rng) for p in problems]


def score_outputs(task, examples: list[Example], outputs: list[str]) -> list[float] | None:
    """Role-specific correctness of each output (all examples must share one role).

    generator/refinement/worker/synthesizer: the task's own reward; evaluator: the verdict matches the
    truth; aggregator: the pick is a correct candidate; orchestrator: at least one parseable STRATEGY line
    naming one of the task's strategies. None when the task cannot be scored here (toy_code before
    `marlflow.sandbox` exists)."""
    role = examples[0].role
    if role == "evaluator":
        verdicts = [(last_boxed(o) or "").strip() for o in outputs]
        return [
            float(v == ("Correct" if e.meta["truth"] else "Incorrect")) for e, v in zip(examples, verdicts)
        ]
    if role == "aggregator":
        return [
            float((last_boxed(o) or "").strip() in map(str, e.meta["good"]))
            for e, o in zip(examples, outputs)
        ]
    if role == "orchestrator":
        return [float(any(s.strip() in task.strategies for _, s in _STRATEGY_RE.findall(o))) for o in outputs]
    try:
        return task.score([e.problem for e in examples], outputs)
    except ImportError:
        return None


@torch.no_grad()
def generate(
    model, tok, messages: list[list[dict]], temperature: float = 0.0, max_new_tokens: int = 64, bs=256
):
    """Completions for a list of chat prompts (greedy when temperature is 0); for measuring only."""
    out = []
    for i in range(0, len(messages), bs):
        enc = tok.apply_chat_template(
            messages[i : i + bs],
            add_generation_prompt=True,
            padding=True,
            return_tensors="pt",
            return_dict=True,
        )
        # Plain sampling (no top-k/top-p), as in RL rollouts.
        sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        gen = model.generate(
            **enc, max_new_tokens=max_new_tokens, **(sample if temperature else {"do_sample": False})
        )
        out += tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def measure(model, tok, n: int, seed: int, temperatures=(0.0, 1.0, 0.7)) -> dict:
    """Accuracy of every role on `n` held-out test problems per task (see warmstart.score_outputs)."""
    from marlflow.core.config import TaskSpec
    from marlflow.tasks import get_task

    acc = {}
    for name in ("toy_math", "toy_code"):
        task = get_task(name)
        problems = task.load("test", TaskSpec(name=name, eval_size=n))
        for role in ROLES:
            examples = role_examples(task, problems, role, random.Random(f"{seed}-{name}-{role}"))
            for t in temperatures if role == "generator" else (0.0,):
                torch.manual_seed(seed)
                outputs = generate(model, tok, [e.messages for e in examples], temperature=t)
                scores = score_outputs(task, examples, outputs)
                acc[f"{name}/{role}/T{t}"] = None if scores is None else round(sum(scores) / len(scores), 4)
    return acc
