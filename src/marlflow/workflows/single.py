"""Single-agent baseline: one generator call per episode; its output is the final answer."""

from marlflow.workflows import Call, prompts


def run(episodes, ctx) -> None:
    calls = [
        (e, Call("generator0", "generator", prompts.solve(ctx.kind, e.problem.prompt))) for e in episodes
    ]
    ctx.generate(calls)
    for e, c in calls:
        e.final = c.text
