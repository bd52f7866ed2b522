"""A task's own evaluation metrics over the solutions its workflow's solver roles wrote.

At every evaluation the trainer hands the outputs of the workflow's solver roles (WorkflowSpec.solver_roles:
generators, workers) to `solution_metrics(task, texts)` and logs what comes back as eval metrics of role
"all", next to accuracy. What is worth measuring there belongs to the task, not to the trainer: a task
gives it with a method `solution_metrics(texts) -> {name: value}` and their names in an attribute
`solution_metric_names` (the model card tabulates them; marlflow.training.final).

The toy tasks (marlflow.tasks.toy) predate that method and their module's bytes are hashed into the shipped
toy model (marlflow.models.loading.check_shipped_toy), so they are adapted here instead: a task with a
`careless(text) -> bool` style test reports `careless_share`, the share of solver outputs in the careless
style that RL should drop (README, "What is learned").

    from marlflow.tasks.solution_metrics import solution_metrics
    solution_metrics(get_task("toy_math"), ["\\boxed{3}", "1+2=3;\\boxed{3}"])   # {"careless_share": 0.5}
    names_of(["toy_math", "smol_math"])   # ("careless_share",): what the report and its rule draw
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

CARELESS = "careless_share"


def metric_names(task) -> tuple[str, ...]:
    """Names of the metrics `solution_metrics` gives for `task` (empty: none)."""
    if hasattr(task, "solution_metrics"):
        return tuple(task.solution_metric_names)
    return (CARELESS,) if hasattr(task, "careless") else ()


def names_of(task_names: Iterable[str]) -> tuple[str, ...]:
    """The solution metric names of the registered tasks `task_names` (marlflow.tasks.get_task; an unknown
    name is a KeyError listing the known ones), each once, in the order of the sorted task names. The report
    (marlflow.report.build) draws its solution-metrics figure, and rules/report.smk declares it, exactly when this is
    not empty."""
    from marlflow.tasks import get_task  # the registry imports every task module: only when asked

    return tuple(dict.fromkeys(n for t in sorted(set(task_names)) for n in metric_names(get_task(t))))


def solution_metrics(task, texts: Sequence[str]) -> dict[str, float]:
    """{metric: value} over `texts` (solver outputs of one evaluation): the task's own `solution_metrics`,
    else careless_share for a task with a `careless` test, else nothing."""
    own = getattr(task, "solution_metrics", None)
    if own is not None:
        return dict(own(texts))
    if hasattr(task, "careless"):
        return {CARELESS: float(np.mean([task.careless(t) for t in texts]))}
    return {}
