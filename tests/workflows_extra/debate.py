"""A two-round debate, defined outside marlflow to show that a workflow is one module plus its prompts.

Round 1: two debaters (debater0, debater1) solve the problem independently. Round 2: each sees its own
answer and the other's and answers again (debater2 revises debater0's, debater3 debater1's). A judge
(judge0) picks one round-2 answer with `\\boxed{N}`, N in 1..2, which is the final answer; anything else
is a judge format failure and picks answer 1.

Nothing in marlflow names this module: tests/test_workflow_spec.py registers it (`register(SPEC)` in the
test process, MARLFLOW_WORKFLOWS=workflows_extra.debate for subprocesses) and trains and aggregates a run.
"""

from __future__ import annotations

from workflows_extra import debate_prompts as prompts

from marlflow.core.workflow_spec import CallSpec, WorkflowSpec
from marlflow.tasks.math import last_boxed
from marlflow.workflows import Call, candidate_metrics

DEBATERS = 2


def parse_pick(text: str) -> tuple[int, bool]:
    """(0-based pick, well_formed): the last \\boxed{N}; otherwise answer 1."""
    boxed = (last_boxed(text) or "").strip()
    if boxed.isdigit() and 1 <= int(boxed) <= DEBATERS:
        return int(boxed) - 1, True
    return 0, False


def run(episodes, ctx) -> None:
    first = [
        (e, Call(f"debater{k}", "debater", prompts.open_round(ctx.kind, e.problem.prompt)))
        for e in episodes
        for k in range(DEBATERS)
    ]
    ctx.generate(first)
    said = {id(e): [] for e in episodes}
    for e, c in first:
        said[id(e)].append(c.text)
    second = [
        (e, Call(f"debater{DEBATERS + k}", "debater",
                 prompts.rebut(ctx.kind, e.problem.prompt, said[id(e)][k], said[id(e)][1 - k])))
        for e in episodes
        for k in range(DEBATERS)
    ]  # fmt: skip
    ctx.generate(second)
    final = {id(e): [] for e in episodes}
    for e, c in second:
        final[id(e)].append(c.text)
    judge = [
        (e, Call("judge0", "judge", prompts.judge(ctx.kind, e.problem.prompt, final[id(e)])))
        for e in episodes
    ]
    ctx.generate(judge)
    for e, c in judge:
        pick, ok = parse_pick(c.text)
        c.format_failure = not ok
        e.final = final[id(e)][pick]
        e.info["candidates"] = final[id(e)]


def stages(cfg, kind: str) -> list[list[CallSpec]]:
    opening = [
        CallSpec(f"debater{k}", "debater", tuple(prompts.open_round(kind, ""))) for k in range(DEBATERS)
    ]
    rebuttal = [
        CallSpec(f"debater{DEBATERS + k}", "debater", tuple(prompts.rebut(kind, "", "", "")),
                 answers=(f"debater{k}", f"debater{1 - k}"))
        for k in range(DEBATERS)
    ]  # fmt: skip
    judge = CallSpec("judge0", "judge", tuple(prompts.judge(kind, "", [""] * DEBATERS)),
                     answers=tuple(f"debater{DEBATERS + k}" for k in range(DEBATERS)))  # fmt: skip
    return [opening, rebuttal, [judge]]


def eval_metrics(episodes, task) -> dict[str, float]:
    """any_correct and debater_accuracy (mean over both round-2 answers)."""
    return candidate_metrics(episodes, task, "debater_accuracy")


SPEC = WorkflowSpec(
    name="debate",
    description="two debaters solve, read each other's answer and answer again; a judge picks one with "
    "`\\boxed{N}`",
    run=run,
    role_types=("debater", "judge"),
    stages=stages,
    first_stage=r"debater[01]",
    mandatory=r"debater\d+|judge0",
    solver_roles=("debater",),
    supervisor=("judge", "debater"),
    own_boxed=r"\s*[12]\s*",
    parallel_role="debater",
    parallel_slots=r"debater\d+",
    problem_prompts={"debater": lambda cfg, kind, text: prompts.open_round(kind, text)},
    prompt_templates=lambda cfg: {
        "debater": [
            prompts.open_round(cfg.task_axis, "{problem}")[-1]["content"],
            prompts.rebut(cfg.task_axis, "{problem}", "{own answer}", "{other answer}")[-1]["content"],
        ],
        "judge": [prompts.judge(cfg.task_axis, "{problem}", ["{answer 1}", "{answer 2}"])[-1]["content"]],
    },
    eval_metrics=eval_metrics,
    eval_metric_names=("any_correct", "debater_accuracy"),
)
