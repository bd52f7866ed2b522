"""voting_shared: Voting whose parallel generators share one sample, so their slot gradients are identical.

The n generators of an episode get the same prompt (as in Voting) and the same completion: generator0 is
sampled, generator1..n-1 take its tokens, as if every slot were sampled with one seed. Rollouts of a problem
still differ (each episode samples its own generator0), so every (problem, slot) group keeps its reward
variance and every slot gets a gradient; within an episode the slots' calls, rewards and advantages are equal,
hence the slots' gradients are equal and slot_amplification = ||sum_i g_i|| / sqrt(sum_i ||g_i||^2) = sqrt(n)
(sqrt(3) for n_votes 3), where independent samples give about 1. The aggregator is Voting's, over the n
(equal) candidates.

    MARLFLOW_WORKFLOWS=induced.voting_shared    (tests/ on PYTHONPATH; workflow: voting_shared)
"""

from __future__ import annotations

import dataclasses

from marlflow.workflows import Call, prompts
from marlflow.workflows.voting import SPEC as VOTING
from marlflow.workflows.voting import parse_pick


def run(episodes, ctx) -> None:
    n = ctx.cfg.n_votes
    first = [
        (e, Call("generator0", "generator", prompts.solve(ctx.kind, e.problem.prompt))) for e in episodes
    ]
    ctx.generate(first)
    sols = {}
    for e, c in first:
        for k in range(1, n):  # the other slots: the same call under their own slot name
            e.calls.append(dataclasses.replace(c, slot=f"generator{k}", prompt_ids=list(c.prompt_ids),
                                               completion_ids=list(c.completion_ids)))  # fmt: skip
        sols[id(e)] = [c.text] * n
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


SPEC = dataclasses.replace(
    VOTING,
    name="voting_shared",
    description="Voting whose generators share one sample per episode (identical parallel slots)",
    run=run,
)
