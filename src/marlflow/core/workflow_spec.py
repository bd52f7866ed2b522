"""What the rest of marlflow knows about a workflow: one frozen `WorkflowSpec` per workflow module, and the
registry that finds them.

Each workflow module (`marlflow.workflows.single`, `eval_opt`, `voting`, `orch_workers`) defines
`SPEC = WorkflowSpec(...)` next to its episode code (`run`). Everything outside the module reads the spec:
the config's allowed values and role types (IP policies), GRPO's group checks (first-stage and mandatory
slots), the interventions' parallel slots, the analysis' supervisor / producer pairs and parallel role, the
memory planner's episode shape, the Snakemake priority's call count, the model card's text and prompts.

    from marlflow.core.workflow_spec import spec_of, workflow_names
    spec = spec_of("voting")
    spec.role_types                      # ("generator", "aggregator"): one IP adapter each
    spec.calls_per_episode(cfg, "math")  # role calls of one episode at most
    workflow_names()                     # ("single", "eval_opt", "voting", "orch_workers", ...)

Adding a workflow is one module plus its prompts (README, "Extending"): write `run(episodes, ctx)` and
`SPEC`, then either add the module's name to BUILTIN (a workflow shipped with marlflow) or, for a workflow
that lives outside the package, name its module in the environment variable MARLFLOW_WORKFLOWS
(comma-separated importable module names, each with a `SPEC`; read by every process, so Snakemake's train
jobs see it too) or call `register(SPEC)` in the process that uses it. tests/workflows_extra/debate.py is
such a workflow; tests/test_workflow_spec.py trains it and aggregates its run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from marlflow.core.registry import env_modules, load_spec

# The workflows shipped with marlflow, as module names under marlflow.workflows, in the order tables, plots
# and the report list them.
BUILTIN = ("single", "eval_opt", "voting", "orch_workers")
# Comma-separated importable modules with a SPEC each, registered after the built-in ones.
ENV_VAR = "MARLFLOW_WORKFLOWS"
NAME = re.compile(r"[a-z][a-z0-9_]*")  # a workflow name is the first part of a run id (voting-ip-toy-...)


class WorkflowError(ValueError):
    """An invalid WorkflowSpec or an unknown workflow; the message names the field or the name and the fix."""


@dataclass(frozen=True)
class CallSpec:
    """One role call of an episode as the memory planner sees it (marlflow.pipeline.plan.slot_tokens): its slot and
    role, its prompt messages with every answer and the question left empty, and what is carried in:

    answers: slots whose completions appear in the prompt whole.
    strategy: the slot whose output is a list of strategies split over the calls that name it here, one
        strategy each (Orch-Workers' workers name "orchestrator0"). Such calls run once per strategy the
        output gave, in order: the k-th runs in the episodes that got more than k (the planner's `workers`).
        None: the call carries no strategy.
    messages_for: for a call whose answers are calls that carry a strategy: `messages_for(n)` is its prompt
        messages when n of them ran (Orch-Workers' synthesizer lists one solution per worker that ran).
        None: `messages` whatever ran."""

    slot: str
    role: str
    messages: tuple
    answers: tuple = ()
    strategy: str | None = None
    messages_for: Callable | None = None

    def __post_init__(self):
        if not (self.strategy is None or (isinstance(self.strategy, str) and self.strategy)):
            raise WorkflowError(f"CallSpec {self.slot!r}: strategy must be the slot whose output the "
                                f"strategies come from, or None; got {self.strategy!r}")  # fmt: skip
        if not (self.messages_for is None or callable(self.messages_for)):
            raise WorkflowError(
                f"CallSpec {self.slot!r}: messages_for must be a function n -> messages or None"
            )


@dataclass(frozen=True)
class WorkflowSpec:
    """Everything outside a workflow's module may know about it.

    name: the workflow's name: the matrix axis value, the first part of a run id, `RunConfig.workflow`
        (lower case letters, digits and underscores; NAME).
    description: what the role graph does in one sentence (the model card's workflow row).
    run: `run(episodes, ctx)`, the episode code: advances all episodes of a step together, stage by stage,
        through `ctx.generate` (marlflow.workflows.Context).
    role_types: the workflow's roles, one entry per role type (numbered calls such as generator0..2 share
        one). Under IP each role type gets its own adapter, in this order (RunConfig.policies); under SP
        they share one. A workflow with one role type runs under SP only.
    stages: `stages(cfg, kind) -> list[list[CallSpec]]`: the role calls of the longest episode, one inner
        list per batched generate (stage), with the prompts the workflow writes and the problem left empty.
        The memory planner reads it (marlflow.pipeline.plan); `calls_per_episode` counts it.
    first_stage: regular expression (fullmatch) of the slots whose prompt depends on the problem alone, so
        it is identical across the G rollouts of a problem (marlflow.core.algos.check_groups checks it).
    mandatory: regular expression (fullmatch) of the slots every episode has, so their GRPO groups hold
        exactly G calls (the others, e.g. Eval-Opt's later rounds, exist only in the episodes that reach them).
    solver_roles: the roles whose output is a whole solution of the problem: what the task's own eval
        metrics look at (marlflow.tasks.solution_metrics, e.g. the toy tasks' careless_share).
    supervisor: (supervisory role, producer role) for capture (marlflow.analysis.failures: the supervisory
        role drifting toward the role it supervises); None: no role supervises another.
    own_boxed: regular expression (fullmatch) of the `\\boxed{...}` contents that are the supervisory role's
        own valid answer (a pick, a verdict); any other boxed content in its output is a solution. None:
        every `\\boxed{}` is a solution (or there is no supervisor).
    parallel_role: the role whose calls run in parallel on the same input in one episode (Voting's
        generators, Orch-Workers' workers): their gradient amplification is claim C6, same_role_norm
        scales them. None: no such role.
    parallel_slots: regular expression (fullmatch) of the parallel role's parallel slots; required with
        parallel_role.
    problem_prompts: role -> `prompt(cfg, kind, problem) -> messages` for the roles whose prompt needs only
        the problem text (`marlflow chat` puts a typed line into it); other roles are sent the line as is.
    prompt_templates: `prompt_templates(cfg) -> {role: [prompt text, ...]}` with placeholders in braces, for
        every role type (the model card shows them).
    eval_metrics: `eval_metrics(episodes, task) -> {name: value}`, the workflow's own evaluation metrics
        (role "all") that only its role graph can say (candidate accuracy, rounds used); None: none.
    eval_metric_names: the names `eval_metrics` returns (plots draw them next to accuracy).
    baseline: True for the single-agent baseline that the MA - SA contrasts subtract and the claims leave
        out of "multi-agent"; exactly one registered workflow has it.
    default_rounds: task kind -> rounds when RunConfig.eval_opt_rounds is 0, for a workflow that runs
        rounds (Eval-Opt: the paper's 3 for math, 2 for code); empty: no rounds. Read through `rounds`.
        A workflow runs rounds iff this is non-empty; its slots are numbered by round (generator0,
        evaluator0, generator1, ...), and an episode reaches round k only after rounds 0..k-1: the memory
        planner (marlflow.pipeline.plan.slot_tokens) reaches round k in continue_frac^k of the episodes.
    """

    name: str
    description: str
    run: Callable
    role_types: tuple[str, ...]
    stages: Callable
    first_stage: str
    mandatory: str
    solver_roles: tuple[str, ...] = ()
    supervisor: tuple[str, str] | None = None
    own_boxed: str | None = None
    parallel_role: str | None = None
    parallel_slots: str | None = None
    problem_prompts: Mapping[str, Callable] = field(default_factory=dict)
    prompt_templates: Callable | None = None
    eval_metrics: Callable | None = None
    eval_metric_names: tuple[str, ...] = ()
    baseline: bool = False
    default_rounds: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self):
        where = f"WorkflowSpec {self.name!r}"

        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise WorkflowError(f"{where}: {msg}")

        check(isinstance(self.name, str) and NAME.fullmatch(self.name) is not None,
              "name must be lower case letters, digits and underscores, starting with a letter (it is the "
              "first part of a run id)")  # fmt: skip
        check(bool(self.description), "description is empty; say what the role graph does in one sentence")
        check(callable(self.run), "run must be the episode function run(episodes, ctx)")
        check(callable(self.stages), "stages must be a function stages(cfg, kind) -> list of stages")
        check(bool(self.role_types) and len(set(self.role_types)) == len(self.role_types),
              "role_types must list each role type once, at least one")  # fmt: skip
        roles = set(self.role_types)
        for fld in ("first_stage", "mandatory", "own_boxed", "parallel_slots"):
            pat = getattr(self, fld)
            if pat is not None:
                try:
                    re.compile(pat)
                except re.error as err:
                    check(False, f"{fld} {pat!r} is not a regular expression ({err})")
        bad = sorted(set(self.solver_roles) - roles)
        check(not bad, f"solver_roles names {bad} which are not in role_types {self.role_types}")
        check(self.supervisor is None or (len(self.supervisor) == 2 and set(self.supervisor) <= roles),
              f"supervisor must be (supervisory role, producer role), both in role_types {self.role_types}")  # fmt: skip
        check(
            self.own_boxed is None or self.supervisor is not None,
            "own_boxed describes a supervisory role's answers; set supervisor too or drop own_boxed",
        )
        check(
            self.parallel_role is None or self.parallel_role in roles,
            f"parallel_role {self.parallel_role!r} is not in role_types {self.role_types}",
        )
        check((self.parallel_role is None) == (self.parallel_slots is None),
              "parallel_role and parallel_slots go together: give both or neither")  # fmt: skip
        bad = sorted(set(self.problem_prompts) - roles)
        check(not bad, f"problem_prompts names {bad} which are not in role_types {self.role_types}")
        check(not self.eval_metric_names or self.eval_metrics is not None,
              "eval_metric_names lists metrics but eval_metrics is None; give the function")  # fmt: skip
        check(all(isinstance(v, int) and v >= 1 for v in self.default_rounds.values()),
              "default_rounds must map task kinds to rounds >= 1")  # fmt: skip

    def rounds(self, cfg, kind: str) -> int:
        """Rounds an episode runs at most: cfg.eval_opt_rounds, or the default for the task kind (0 if the
        workflow runs no rounds)."""
        return cfg.eval_opt_rounds or self.default_rounds.get(kind, 0)

    def calls_per_episode(self, cfg, kind: str) -> int:
        """Role calls of one episode at most (the longest episode `stages` describes)."""
        return sum(len(stage) for stage in self.stages(cfg, kind))

    def is_parallel_slot(self, role: str, slot: str) -> bool:
        """Is `slot` one of `role`'s parallel same-role slots?"""
        return role == self.parallel_role and re.fullmatch(self.parallel_slots, slot) is not None

    def agents(self, cfg, kind: str) -> tuple[str, ...]:
        """The workflow's agent instances, in role_types order: each role type once, except the parallel role,
        which is its parallel slots in `stages` order (Voting: generator0..N-1, aggregator). Sharing 'agent'
        gives each its own adapter (RunConfig.policies)."""
        slots = [
            c.slot for stage in self.stages(cfg, kind) for c in stage if self.is_parallel_slot(c.role, c.slot)
        ]
        out = []
        for role in self.role_types:
            out += list(dict.fromkeys(slots)) if role == self.parallel_role else [role]
        return tuple(out)

    def is_first_stage(self, slot: str) -> bool:
        return re.fullmatch(self.first_stage, slot) is not None

    def is_mandatory(self, slot: str) -> bool:
        return re.fullmatch(self.mandatory, slot) is not None


_REGISTERED: dict[str, WorkflowSpec] = {}


def register(spec: WorkflowSpec) -> WorkflowSpec:
    """Add a workflow defined outside marlflow.workflows to this process's registry (returns it). A
    different spec under a registered name is refused: two workflows would answer to one name."""
    if not isinstance(spec, WorkflowSpec):
        raise WorkflowError(f"register() takes a WorkflowSpec, not {type(spec).__name__}")
    known = _REGISTERED.get(spec.name) or _builtin().get(spec.name)
    if known is not None and known is not spec:
        raise WorkflowError(f"workflow {spec.name!r} is already registered; give the new one another name")
    _REGISTERED[spec.name] = spec
    return spec


_BUILTIN: dict[str, WorkflowSpec] = {}


def _builtin() -> dict[str, WorkflowSpec]:
    if not _BUILTIN:
        for mod in BUILTIN:
            spec = load_spec(
                f"marlflow.workflows.{mod}",
                WorkflowSpec,
                "marlflow.core.workflow_spec.BUILTIN",
                WorkflowError,
            )
            _BUILTIN[spec.name] = spec
    return _BUILTIN


def specs() -> dict[str, WorkflowSpec]:
    """Every known workflow, name -> spec: the built-in ones in BUILTIN order, then those named in
    MARLFLOW_WORKFLOWS, then those given to register()."""
    out = dict(_builtin())
    for mod in env_modules(ENV_VAR):
        register(load_spec(mod, WorkflowSpec, ENV_VAR, WorkflowError))
    out.update(_REGISTERED)
    baselines = [n for n, s in out.items() if s.baseline]
    if len(baselines) != 1:
        raise WorkflowError(f"exactly one workflow must be the single-agent baseline (baseline=True); found "
                            f"{baselines or 'none'}")  # fmt: skip
    return out


def workflow_names() -> tuple[str, ...]:
    """Names of every known workflow, in table order."""
    return tuple(specs())


def spec_of(name: str) -> WorkflowSpec:
    """The spec of workflow `name`; WorkflowError naming the known ones if there is none."""
    known = specs()
    if name not in known:
        raise WorkflowError(f"workflow {name!r} is unknown; choose one of {tuple(known)} (a workflow outside "
                            f"marlflow: name its module in {ENV_VAR})")  # fmt: skip
    return known[name]


def baseline() -> str:
    """The single-agent baseline's name (the workflow with baseline=True)."""
    return next(n for n, s in specs().items() if s.baseline)
