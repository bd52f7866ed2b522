"""Eval-Opt: a generator solves, an evaluator judges, the generator refines until "Correct" or out of rounds.

Rounds (generator calls at most) are `cfg.eval_opt_rounds`, or the paper's 3 for math and 2 for code.
The conversation history is shared: the evaluator sees the generator's turn as earlier conversation and
its critique becomes an assistant turn that the refinement request refers back to (paper section 5).
Verdict parsing: the last `\\boxed{Correct}` / `\\boxed{Incorrect}` (case-insensitive); anything else is a
format failure and is treated as Incorrect. The final answer is the last generator output.
"""

import numpy as np

from marlflow.tasks.math import last_boxed
from marlflow.workflows import Call, prompts


def parse_verdict(text: str) -> tuple[bool, bool]:
    """(says_correct, well_formed)."""
    v = (last_boxed(text) or "").strip().lower()
    if v in ("correct", "incorrect"):
        return v == "correct", True
    return False, False


def run(episodes, ctx) -> None:
    rounds = ctx.cfg.eval_opt_rounds or (3 if ctx.kind == "math" else 2)
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
