"""A run's three problem sets: training, validation and test, from a task's two splits ("train", "test").

    from marlflow.tasks.splits import run_splits
    train, val, test = run_splits(task, cfg.task)   # cfg.task: marlflow.core.config.TaskSpec

test: the first `eval_size` problems of the task's test split, as before validation existed. val: `val_size`
problems of the task's train split that training never sees, so that whatever selects (cliff_guard, the
analysis's held-out peak step) never reads a test outcome (docs/claims.md, section 1). Tasks cap their
train split by a prefix of a fixed order (toy, smol, math: `train_size` first problems), so loading
`train_size + val_size` problems gives the training problems unchanged followed by `val_size` more: the
validation set. A task whose train split is used whole (train_size 0 and no more problems than that) gives
its last `val_size` problems to validation instead, and trains on the rest. The task modules themselves are
not touched (tasks/toy.py is hashed into the shipped toy model's version, marlflow.models.toybuild).
"""

from __future__ import annotations

import dataclasses

from marlflow.tasks import Problem


def eval_problems(task, spec) -> list[Problem]:
    """The first `spec.eval_size` problems of the task's test split: what every evaluation scores."""
    return task.load("test", spec)[: spec.eval_size]


def run_splits(task, spec) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """(train, val, test) problems of `task` under `spec` (a TaskSpec); val is [] when spec.val_size is 0.

    Raises ValueError when the train split is too small to hold out `val_size` problems and keep some for
    training, or when a validation problem's prompt is also a test problem's (a task whose splits overlap)."""
    train = task.load("train", spec)
    test = eval_problems(task, spec)
    v = spec.val_size
    if v == 0:
        return train, [], test
    wider = task.load("train", dataclasses.replace(spec, train_size=len(train) + v))
    if len(wider) >= len(train) + v and wider[: len(train)] == train:
        val = wider[len(train) : len(train) + v]
    else:  # the whole train split is in use: hold its last val_size problems out of training
        if len(train) <= v:
            raise ValueError(
                f"task {spec.name!r}: its train split has {len(train)} problems, too few to hold out "
                f"task.val_size={v} for validation and train on the rest; lower task.val_size"
            )
        train, val = train[:-v], train[-v:]
    overlap = {p.prompt for p in val} & {p.prompt for p in test}
    if overlap:
        raise ValueError(
            f"task {spec.name!r}: {len(overlap)} validation problem(s) are also test problems (e.g. "
            f"{next(iter(overlap))[:60]!r}); its train and test splits overlap, so it cannot have a validation set"
        )
    return train, val, test
