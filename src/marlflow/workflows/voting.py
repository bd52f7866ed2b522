"""Voting: `n_votes` generators answer the same prompt in parallel; an aggregator picks one by number.

The final answer is the picked generator's output (paper section 5). Pick parsing: the last
`\\boxed{N}` with N in 1..n; otherwise the first digit 1..n in the text; otherwise candidate 1. Anything
but a well-formed `\\boxed{N}` counts as an aggregator format failure.
"""

import re

from marlflow.core.workflow_spec import CallSpec, WorkflowSpec
from marlflow.tasks.math import last_boxed
from marlflow.workflows import Call, candidate_metrics, prompts
from marlflow.workflows.single import solve_template


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


def stages(cfg, kind: str) -> list[list[CallSpec]]:
    n = cfg.n_votes
    gens = [CallSpec(f"generator{k}", "generator", tuple(prompts.solve(kind, ""))) for k in range(n)]
    agg = CallSpec("aggregator0", "aggregator", tuple(prompts.aggregate(kind, "", [""] * n)),
                   answers=tuple(f"generator{k}" for k in range(n)))  # fmt: skip
    return [gens, [agg]]


def prompt_templates(cfg) -> dict[str, list[str]]:
    sols = [f"{{solution {i}}}" for i in range(1, cfg.n_votes + 1)]
    return {
        "generator": [solve_template(cfg)],
        "aggregator": [prompts.aggregate(cfg.task_axis, "{problem}", sols)[-1]["content"]],
    }


SPEC = WorkflowSpec(
    name="voting",
    description="several generators solve the same prompt, an aggregator picks one with `\\boxed{N}`; the picked "
    "solution is the answer",
    run=run,
    role_types=("generator", "aggregator"),
    stages=stages,
    first_stage=r"generator\d+",
    mandatory=r"generator\d+|aggregator0",
    solver_roles=("generator",),
    supervisor=("aggregator", "generator"),
    own_boxed=r"\s*\d+\s*",
    parallel_role="generator",
    parallel_slots=r"generator\d+",
    problem_prompts={"generator": lambda cfg, kind, text: prompts.solve(kind, text)},
    prompt_templates=prompt_templates,
    eval_metrics=eval_metrics,
    eval_metric_names=("any_correct", "generator_accuracy"),
)
