"""Single-agent baseline: one generator call per episode; its output is the final answer."""

from marlflow.core.workflow_spec import CallSpec, WorkflowSpec
from marlflow.workflows import Call, prompts


def run(episodes, ctx) -> None:
    calls = [
        (e, Call("generator0", "generator", prompts.solve(ctx.kind, e.problem.prompt))) for e in episodes
    ]
    ctx.generate(calls)
    for e, c in calls:
        e.final = c.text


def stages(cfg, kind: str) -> list[list[CallSpec]]:
    return [[CallSpec("generator0", "generator", tuple(prompts.solve(kind, "")))]]


def solve_template(cfg) -> str:
    """The generator's prompt with a {problem} placeholder (shared by every workflow whose generator solves)."""
    return prompts.solve(cfg.task_axis, "{problem}")[-1]["content"]


SPEC = WorkflowSpec(
    name="single",
    description="one generator answers (single-agent baseline)",
    run=run,
    role_types=("generator",),
    stages=stages,
    first_stage=r"generator0",
    mandatory=r"generator0",
    solver_roles=("generator",),
    problem_prompts={"generator": lambda cfg, kind, text: prompts.solve(kind, text)},
    prompt_templates=lambda cfg: {"generator": [solve_template(cfg)]},
    baseline=True,
)
