"""Voting: `n_votes` generators answer the same prompt in parallel; an aggregator picks one by number.

The final answer is the picked generator's output (paper section 5). Pick parsing: the last
`\\boxed{N}` with N in 1..n; otherwise the first digit 1..n in the text; otherwise candidate 1. Anything
but a well-formed `\\boxed{N}` counts as an aggregator format failure.
"""

import re

from marlflow.tasks.math import last_boxed
from marlflow.workflows import Call, candidate_metrics, prompts


def parse_pick(text: str, n: int) -> tuple[int, bool]:
    """(0-based pick, well_formed)."""
    boxed = (last_boxed(text) or "").strip()
    if boxed.isdigit() and 1 <= int(boxed) <= n:
        return int(boxed) - 1, True
    m = re.search(f"[1-{n}]", text)
    return (int(m.group()) - 1 if m else 0), False


def run(episodes, ctx) -> None:
    n = ctx.cfg.n_votes
    stage = [
        (e, Call(f"generator{k}", "generator", prompts.solve(ctx.kind, e.problem.prompt)))
        for e in episodes
        for k in range(n)
    ]
    ctx.generate(stage)
    sols = {id(e): [] for e in episodes}
    for e, c in stage:
        sols[id(e)].append(c.text)
    agg = [
        (e, Call("aggregator0", "aggregator", prompts.aggregate(ctx.kind, e.problem.prompt, sols[id(e)])))
        for e in episodes
    ]
    ctx.generate(agg)
    for e, c in agg:
        pick, ok = parse_pick(c.text, n)
        c.format_failure = not ok
        e.final = sols[id(e)][pick]
        e.info["pick"] = pick
        e.info["candidates"] = sols[id(e)]


def eval_metrics(episodes, task) -> dict[str, float]:
    """any_correct and generator_accuracy (mean over every voter's answer): how often the aggregator had a
    right answer to pick, and how good the voters are on their own."""
    return candidate_metrics(episodes, task, "generator_accuracy")
