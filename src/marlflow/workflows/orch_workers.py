"""Orch-Workers: an orchestrator proposes strategies, workers solve with one each, a synthesizer answers.

The orchestrator's `STRATEGY k: ...` lines are parsed and cut to `cfg.n_workers` (paper: 3); each worker
solves the whole problem with its strategy; the synthesizer sees all worker solutions and its output is
the final answer. No parseable strategy line is a format failure; the fallback is one worker with the
generic strategy "solve it directly".
"""

import re

from marlflow.core.workflow_spec import CallSpec, WorkflowSpec
from marlflow.workflows import Call, candidate_metrics, prompts

FALLBACK_STRATEGY = "solve it directly"


def parse_strategies(text: str, n: int) -> tuple[list[str], bool]:
    found = [s.strip() for s in re.findall(r"STRATEGY\s*\d+\s*:\s*(.+)", text) if s.strip()]
    if not found:
        return [FALLBACK_STRATEGY], False
    return found[:n], True


def run(episodes, ctx) -> None:
    n = ctx.cfg.n_workers
    orch = [
        (e, Call("orchestrator0", "orchestrator", prompts.orchestrate(ctx.kind, e.problem.prompt, n)))
        for e in episodes
    ]
    ctx.generate(orch)
    workers = []
    for e, c in orch:
        strategies, ok = parse_strategies(c.text, n)
        c.format_failure = not ok
        e.info["strategies"] = strategies
        workers += [
            (e, Call(f"worker{k}", "worker", prompts.work(ctx.kind, e.problem.prompt, s)))
            for k, s in enumerate(strategies)
        ]
    ctx.generate(workers)
    sols = {id(e): [] for e in episodes}
    for e, c in workers:
        sols[id(e)].append(c.text)
    synth = [
        (e, Call("synthesizer0", "synthesizer", prompts.synthesize(ctx.kind, e.problem.prompt, sols[id(e)])))
        for e in episodes
    ]
    ctx.generate(synth)
    for e, c in synth:
        e.final = c.text
        e.info["candidates"] = sols[id(e)]


def eval_metrics(episodes, task) -> dict[str, float]:
    """any_correct and worker_accuracy (mean over every worker's solution)."""
    return candidate_metrics(episodes, task, "worker_accuracy")


def stages(cfg, kind: str) -> list[list[CallSpec]]:
    """Orchestrator, n_workers workers (each carries a share of the orchestrator's strategies), synthesizer."""
    n = cfg.n_workers
    orch = CallSpec("orchestrator0", "orchestrator", tuple(prompts.orchestrate(kind, "", n)))
    workers = [CallSpec(f"worker{k}", "worker", tuple(prompts.work(kind, "", "")), strategy=orch.slot)
               for k in range(n)]  # fmt: skip
    synth = CallSpec("synthesizer0", "synthesizer", tuple(prompts.synthesize(kind, "", [""] * n)),
                     answers=tuple(f"worker{k}" for k in range(n)),
                     messages_for=lambda ran: tuple(prompts.synthesize(kind, "", [""] * ran)))  # fmt: skip
    return [[orch], workers, [synth]]


def prompt_templates(cfg) -> dict[str, list[str]]:
    k, p, n = cfg.task_axis, "{problem}", cfg.n_workers
    sols = [f"{{solution {i}}}" for i in range(1, n + 1)]
    return {
        "orchestrator": [prompts.orchestrate(k, p, n)[-1]["content"]],
        "worker": [prompts.work(k, p, "{strategy}")[-1]["content"]],
        "synthesizer": [prompts.synthesize(k, p, sols)[-1]["content"]],
    }


SPEC = WorkflowSpec(
    name="orch_workers",
    description="an orchestrator proposes `STRATEGY k:` lines, one worker solves with each, a synthesizer "
    "compares them and gives the answer",
    run=run,
    role_types=("orchestrator", "worker", "synthesizer"),
    stages=stages,
    first_stage=r"orchestrator0",
    mandatory=r"orchestrator0|worker0|synthesizer0",
    solver_roles=("worker",),
    supervisor=("orchestrator", "worker"),
    own_boxed=None,  # orchestrators only plan: any \boxed{} in their output is a solution
    parallel_role="worker",
    parallel_slots=r"worker\d+",
    problem_prompts={"orchestrator": lambda cfg, kind, text: prompts.orchestrate(kind, text, cfg.n_workers)},
    prompt_templates=prompt_templates,
    eval_metrics=eval_metrics,
    eval_metric_names=("any_correct", "worker_accuracy"),
)
