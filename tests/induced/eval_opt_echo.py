"""eval_opt_echo: one Eval-Opt round whose evaluator call repeats the generator's call (same prompt, same
completion), so under SP the two roles' gradients are identical.

The generator solves, as in Eval-Opt's first round, and its output is the answer. The evaluator is given the
generator's prompt and completion as its own call (its verdict is parsed as Eval-Opt parses one, so it is
nearly always a format failure; no refinement round follows). Both calls get the episode's reward, and their
(problem, slot) groups hold the same rewards, hence the same advantages: the evaluator's part of the shared
gradient equals the generator's, and cos_others (the cosine of a role's gradient with the rest of its
policy's) is 1 for both, where Eval-Opt's independent roles give about 0.

    MARLFLOW_WORKFLOWS=induced.eval_opt_echo    (tests/ on PYTHONPATH; workflow: eval_opt_echo)
"""

from __future__ import annotations

import dataclasses

from marlflow.core.workflow_spec import CallSpec
from marlflow.workflows import Call, prompts
from marlflow.workflows.eval_opt import SPEC as EVAL_OPT
from marlflow.workflows.eval_opt import parse_verdict


def run(episodes, ctx) -> None:
    gen = [(e, Call("generator0", "generator", prompts.solve(ctx.kind, e.problem.prompt))) for e in episodes]
    ctx.generate(gen)
    for e, c in gen:
        e.final = c.text
        e.info["rounds"] = 1
        echo = dataclasses.replace(c, slot="evaluator0", role="evaluator", prompt_ids=list(c.prompt_ids),
                                   completion_ids=list(c.completion_ids))  # fmt: skip
        echo.format_failure = not parse_verdict(c.text)[1]
        e.calls.append(echo)


def stages(cfg, kind: str) -> list[list[CallSpec]]:
    """The generator, then the evaluator with the generator's prompt and completion (it generates nothing)."""
    solve = tuple(prompts.solve(kind, ""))
    return [[CallSpec("generator0", "generator", solve)], [CallSpec("evaluator0", "evaluator", solve)]]


SPEC = dataclasses.replace(
    EVAL_OPT,
    name="eval_opt_echo",
    description="one Eval-Opt round whose evaluator call repeats the generator's call (identical roles)",
    run=run,
    stages=stages,
    default_rounds={},
)
