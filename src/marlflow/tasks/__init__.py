"""Task registry: task name -> dataset loader, prompt text and verifier.

A task turns a dataset into `Problem`s and scores final answers with a reward in [0, 1]. Workflows
never look inside a task: they show `Problem.prompt` to roles and hand the workflow's final output to
`Task.score`. Register a new task by adding it to `TASKS`.

    from marlflow.tasks import get_task
    task = get_task("gsm8k")
    problems = task.load("test", spec)          # spec: marlflow.core.config.TaskSpec
    rewards = task.score(problems, outputs)     # one float per (problem, output) pair
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    """One problem. `kind` is "math" or "code"; for code, `tests` is Python test code (asserts)
    run after the solution in the sandbox, `entry_point` the function HumanEval-style tests call."""

    uid: str
    task: str
    kind: str
    prompt: str
    answer: str
    tests: str = ""
    entry_point: str = ""
    meta: dict = field(default_factory=dict, compare=False, hash=False)


class Task(Protocol):
    name: str
    kind: str  # "math" | "code"

    def load(self, split: str, spec) -> list[Problem]:
        """Problems of `split` ("train" or "test"), in a deterministic order."""

    def extract(self, text: str) -> str | None:
        """The final answer (math) or program (code) in a model output; None if there is none."""

    def score(self, problems: Sequence[Problem], outputs: Sequence[str]) -> list[float]:
        """Reward in [0, 1] for each output; batched so code tasks can verify in parallel."""


TASKS: dict[str, Callable[[], Task]] = {}


def register(name: str):
    def deco(factory):
        TASKS[name] = factory
        return factory

    return deco


def get_task(name: str) -> Task:
    _load_builtin()
    if name not in TASKS:
        raise KeyError(f"task {name!r} is not registered; known tasks: {sorted(TASKS)}")
    return TASKS[name]()


def _load_builtin() -> None:
    # Imported lazily so that `marlflow.tasks` stays cheap to import and free of cycles.
    from marlflow.tasks import toy, toy2  # noqa: F401

    for mod in ("math", "code", "smol"):
        try:
            __import__(f"marlflow.tasks.{mod}")
        except ModuleNotFoundError as err:
            if err.name != f"marlflow.tasks.{mod}":
                raise
