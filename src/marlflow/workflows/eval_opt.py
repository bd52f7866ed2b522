"""Eval-Opt: a generator solves, an evaluator judges, the generator refines until "Correct" or out of rounds.

Rounds (generator calls at most) are `cfg.eval_opt_rounds`, or the paper's 3 for math and 2 for code
(SPEC.default_rounds).
The conversation history is shared: the evaluator sees the generator's turn as earlier conversation and
its critique becomes an assistant turn that the refinement request refers back to (paper section 5).
Verdict parsing: the last `\\boxed{Correct}` / `\\boxed{Incorrect}` (case-insensitive); anything else is a
format failure and is treated as Incorrect. The final answer is the last generator output.
"""

import numpy as np

from marlflow.core.workflow_spec import CallSpec, WorkflowSpec
from marlflow.tasks.math import last_boxed
from marlflow.workflows import Call, prompts
from marlflow.workflows.single import solve_template


def parse_verdict(text: str) -> tuple[bool, bool]:
    """(says_correct, well_formed)."""
    v = (last_boxed(text) or "").strip().lower()
    if v in ("correct", "incorrect"):
        return v == "correct", True
    return False, False


def run(episodes, ctx) -> None:
    rounds = SPEC.rounds(ctx.cfg, ctx.kind)
    history = {id(e): prompts.solve(ctx.kind, e.problem.prompt) for e in episodes}
    active = list(episodes)
    for k in range(rounds):
        gen = [(e, Call(f"generator{k}", "generator", history[id(e)])) for e in active]
        ctx.generate(gen)
        for e, c in gen:
            e.final = c.text
            e.info["rounds"] = k + 1
            history[id(e)] = [*history[id(e)], {"role": "assistant", "content": c.text}]
        judge = [
            (
                e,
                Call(
                    f"evaluator{k}", "evaluator", prompts.evaluate(ctx.kind, e.problem.prompt, history[id(e)])
                ),
            )
            for e in active
        ]
        ctx.generate(judge)
        still = []
        for e, c in judge:
            correct, ok = parse_verdict(c.text)
            c.format_failure = not ok
            if not correct and k + 1 < rounds:
                critique = [*c.messages[-1:], {"role": "assistant", "content": c.text}]
                history[id(e)] = prompts.refine(ctx.kind, [*history[id(e)], *critique])
                still.append(e)
        active = still
        if not active:
            break


def eval_metrics(episodes, task) -> dict[str, float]:
    """rounds_mean: generator calls used per episode (1 = the evaluator accepted the first answer)."""
    return {"rounds_mean": float(np.mean([e.info.get("rounds", 1) for e in episodes]))}


def stages(cfg, kind: str) -> list[list[CallSpec]]:
    """Every round, generator then evaluator (the longest episode: one stops early when its evaluator says
    Correct); each prompt carries the conversation so far."""
    history, carried, out = list(prompts.solve(kind, "")), [], []
    for k in range(SPEC.rounds(cfg, kind)):
        gen = CallSpec(f"generator{k}", "generator", tuple(history), answers=tuple(carried))
        history = [*history, {"role": "assistant", "content": ""}]
        carried = [*carried, f"generator{k}"]
        ev_msgs = prompts.evaluate(kind, "", history)
        ev = CallSpec(f"evaluator{k}", "evaluator", tuple(ev_msgs), answers=tuple(carried))
        out += [[gen], [ev]]
        history = prompts.refine(kind, [*history, ev_msgs[-1], {"role": "assistant", "content": ""}])
        carried = [*carried, f"evaluator{k}"]
    return out


def prompt_templates(cfg) -> dict[str, list[str]]:
    """The generator's first and refinement prompts and the evaluator's, with placeholders in braces."""
    k, p = cfg.task_axis, "{problem}"
    history = [*prompts.solve(k, p), {"role": "assistant", "content": "{solution}"}]
    refine = prompts.refine(k, [*history, {"role": "assistant", "content": "{critique}"}])[-1]["content"]
    return {
        "generator": [solve_template(cfg), refine],
        "evaluator": [prompts.evaluate(k, p, history)[-1]["content"]],
    }


SPEC = WorkflowSpec(
    name="eval_opt",
    description="a generator solves, an evaluator judges `\\boxed{Correct}`/`\\boxed{Incorrect}`, the generator "
    "refines until Correct or out of rounds; the last generator output is the answer",
    run=run,
    role_types=("generator", "evaluator"),
    stages=stages,
    first_stage=r"generator0",
    mandatory=r"generator0|evaluator0",
    solver_roles=("generator",),
    supervisor=("evaluator", "generator"),
    own_boxed=r"\s*(?:(?i:correct|incorrect))\s*",
    problem_prompts={"generator": lambda cfg, kind, text: prompts.solve(kind, text)},
    prompt_templates=prompt_templates,
    eval_metrics=eval_metrics,
    eval_metric_names=("rounds_mean",),
    default_rounds={"math": 3, "code": 2},
)
