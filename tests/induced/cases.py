"""Each diagnostic's induced run and matched null run, and how the diagnostic is read off a run.

    from induced import cases
    cases.use_plugins()                               # the inducers, registered the documented way
    for name, case in cases.CASES.items():            # cliff, cliff_paired, collapse, stagnation, ...
        for which in ("induced", "null"):
            cfg = cases.config(getattr(case, which), seed=0)    # the toy preset's cell, scaled down, changed
            run_dir = cases.train(cfg, runs / cfg.run_id)       # the project's trainer, in this process
            rows = cases.readout(name, run_dir)                  # [{metric, value, flag}, ...]

A run is a cell of the toy preset (matrix.yaml: the shipped model results/models/toy, its prompts, learning
rate and sampling) at a smaller scale (fewer steps, problems, evaluations) with one change for the induced
case: an inducer of this folder (a workflow or an intervention), the example plug-in role_gain, or a learning
rate. The null run is the same cell without the change. The diagnostics are read with the project's own
analysis code (analysis.failures for cliff, collapse, stagnation and capture; analysis.paired for the paired
cliff test; analysis.gradients for the gradient metrics), so the flags are the ones the aggregate and the
report compute. Slot amplification and cross-role cosine are logged as numbers without a flag; their flag here
is a threshold halfway between the independent and the identical value.

Used by tests/test_induced_diagnostics.py (one test per diagnostic) and benchmarks/diagnostics/induced.py
(over seeds, into results/evidence/diagnostics/); docs/diagnostics.md describes each mechanism.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
MODEL = ROOT / "results" / "models" / "toy"
MATRIX = ROOT / "matrix.yaml"
# The inducers, named in the variables every marlflow process reads (core.workflow_spec, .intervention_spec).
PLUGINS = {
    "MARLFLOW_WORKFLOWS": "induced.voting_shared,induced.eval_opt_echo",
    "MARLFLOW_INTERVENTIONS": "induced.lr_spike,induced.grad_scale,interventions_extra.role_gain",
}
# The flags of the two gradient metrics: halfway between independent and identical. slot_amplification is 1
# for orthogonal slot gradients and sqrt(n_votes) for identical ones (n_votes 3, RunConfig's default, as in
# the toy); cos_others is 0 for orthogonal role gradients and 1 for identical ones.
N_VOTES = 3
AMPLIFICATION_FLAG = (1 + math.sqrt(N_VOTES)) / 2
COSINE_FLAG = 0.5


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a case: the toy preset's (workflow, sharing, math) cell with these changes.

    name: the run's tag (in its run id), shared by the cases that use the same run; cell: the toy cell whose
    settings it takes; workflow: the workflow that runs (an inducer's; "" = the cell's); grpo / task / run:
    field overrides of GRPOParams, TaskSpec and RunConfig; intervention: (name, definition) or None."""

    name: str
    cell: str
    sharing: str
    workflow: str = ""
    grpo: tuple = ()
    task: tuple = ()
    run: tuple = ()
    intervention: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Case:
    """A diagnostic's induced run and its matched null (the same cell without the inducer)."""

    diagnostic: str
    induced: RunSpec
    null: RunSpec
    mechanism: str


# Curve diagnostics: Single (the cheapest cell, 0.3 s per toy step) evaluated every 2 steps on the toy's 200
# test and 64 validation problems (the paired cliff test picks its peak on validation): 7 evaluations a curve.
_CURVE = dict(cell="single", sharing="sp", grpo=(("steps", 12), ("eval_every", 2), ("save_every", 12)))
SINGLE_NULL = RunSpec("null", **_CURVE)
SINGLE_SPIKE = RunSpec(
    "spike", **_CURVE, intervention=("spike", {"kind": "lr_spike", "at": 6, "factor": 50.0})
)
SINGLE_WRONG = RunSpec("wrong", **_CURVE, intervention=("wrong", {"kind": "grad_scale", "factor": -1.0}))
SINGLE_FROZEN = RunSpec(
    "frozen", cell="single", sharing="sp", grpo=(*_CURVE["grpo"], ("learning_rate", 1e-6))
)
# Gradient diagnostics: a few steps are enough (the metrics are per step); evaluations are not read.
_GRAD = dict(grpo=(("steps", 3), ("eval_every", 3), ("save_every", 3), ("problems_per_step", 4),
                   ("group_size", 4)), task=(("eval_size", 16), ("val_size", 0)))  # fmt: skip
VOTING_NULL = RunSpec("null", cell="voting", sharing="ip", **_GRAD)
VOTING_SHARED = RunSpec("shared", cell="voting", sharing="ip", workflow="voting_shared", **_GRAD)
EVAL_OPT_NULL = RunSpec("null", cell="eval_opt", sharing="sp", run=(("eval_opt_rounds", 1),), **_GRAD)
EVAL_OPT_ECHO = RunSpec("echo", cell="eval_opt", sharing="sp", workflow="eval_opt_echo",
                        run=(("eval_opt_rounds", 1),), **_GRAD)  # fmt: skip
# Capture: the aggregator's evaluations at step 0 and the last step are compared. Only the generators are
# paid (the aggregator's gradient x 0, tests/interventions_extra/role_gain): under SP the aggregator's policy
# is then the generators' adapter trained on their calls alone; under IP (the null) it keeps its own adapter,
# untrained, and only its inputs (the generators' answers) change. Twice the toy's rate (toy_long's): 16 steps
# suffice.
_GEN_ONLY = ("gen_only", {"kind": "role_gain", "gain": {"aggregator": 0.0}})
_CAPTURE = dict(cell="voting", grpo=(("steps", 16), ("eval_every", 16), ("save_every", 16),
                                     ("problems_per_step", 4), ("learning_rate", 4e-3)),
                task=(("val_size", 0),), intervention=_GEN_ONLY)  # fmt: skip
CAPTURE_SP = RunSpec("gen_only", sharing="sp", **_CAPTURE)
CAPTURE_IP = RunSpec("gen_only", sharing="ip", **_CAPTURE)

CASES = {
    "cliff": Case("cliff", SINGLE_SPIKE, SINGLE_NULL,
                  "Single; learning rate x 50 after the evaluation of step 6 (induced.lr_spike)"),
    "cliff_paired": Case("cliff_paired", SINGLE_SPIKE, SINGLE_NULL,
                         "the cliff runs, read by the paired test (validation-chosen step vs terminal)"),
    "collapse": Case("collapse", SINGLE_WRONG, SINGLE_NULL,
                     "Single; the update of a reward paying wrong answers: every gradient x -1 "
                     "(induced.grad_scale)"),
    "stagnation": Case("stagnation", SINGLE_FROZEN, SINGLE_NULL,
                       "Single; learning rate 1e-6 instead of 2e-3"),
    "capture": Case("capture", CAPTURE_SP, CAPTURE_IP,
                    "Voting; only the generators are paid (aggregator gradient x 0, role_gain) and the "
                    "aggregator shares their adapter (SP); null: the same under IP"),
    "amplification": Case("amplification", VOTING_SHARED, VOTING_NULL,
                          "Voting IP; the 3 generators of an episode share one sample "
                          "(induced.voting_shared)"),
    "cross_role": Case("cross_role", EVAL_OPT_ECHO, EVAL_OPT_NULL,
                       "Eval-Opt SP, one round; the evaluator's call repeats the generator's "
                       "(induced.eval_opt_echo)"),
}  # fmt: skip


def use_plugins(environ=None) -> None:
    """Name the inducers in `environ` (default os.environ) and put tests/ on sys.path, so this process and the
    processes it starts register them as any plug-in is registered."""
    environ = os.environ if environ is None else environ
    for var, mods in PLUGINS.items():
        have = [m for m in environ.get(var, "").split(",") if m]
        environ[var] = ",".join(dict.fromkeys([*have, *mods.split(",")]))
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))


def ensure_model() -> None:
    """results/models/toy as the `toy` preset's models rule leaves it (the shipped v1 model, copied after its hash
    check; seconds): the default preset is toy2 now, so no `make run` puts it there."""
    from marlflow.models.loading import prepare

    if not (MODEL / "READY").is_file():
        prepare("toy", "toy", MODEL)


def config(spec: RunSpec, seed: int):
    """The RunConfig of `spec` at `seed`: the toy preset's cell (matrix.yaml), changed as the spec says."""
    import json

    from marlflow.core.config import RunConfig
    from marlflow.pipeline.matrix import run_id, run_sheet

    ensure_model()
    sheet = run_sheet(str(MATRIX), "toy", {"workflow": [spec.cell], "sharing": [spec.sharing],
                                           "task": ["math"]})  # fmt: skip
    cfg = RunConfig.from_dict(json.loads(sheet["config"].iloc[0]))
    workflow = spec.workflow or spec.cell
    name, definition = spec.intervention or ("none", {"kind": "none"})
    return dataclasses.replace(
        cfg,
        run_id=run_id(workflow, spec.sharing, "toy", "math", seed, name, tag=f"induced_{spec.name}"),
        workflow=workflow,
        seed=seed,
        model=str(MODEL),
        intervention=name,
        intervention_spec=definition,
        grpo=dataclasses.replace(cfg.grpo, **dict(spec.grpo)),
        task=dataclasses.replace(cfg.task, **dict(spec.task)),
        **dict(spec.run),
    )


def train(cfg, out_dir: Path) -> Path:
    """Train `cfg` into `out_dir` with the project's trainer (marlflow.cli.train.run); returns `out_dir`."""
    from marlflow.cli.train import run

    run(cfg, Path(out_dir))
    return Path(out_dir)


def metrics(run_dir: Path):
    """A run's metrics.parquet as the analysis reads it (with the build column)."""
    import pandas as pd

    from marlflow.store.schema import with_build

    return with_build(pd.read_parquet(Path(run_dir) / "metrics.parquet"))


def _role_eval(m, role: str, metric: str) -> tuple[float, float]:
    """(first, last) eval value of a role's metric."""
    sel = m[(m.split == "eval") & (m.role == role) & (m.metric == metric)].sort_values("step")
    return float(sel.value.iloc[0]), float(sel.value.iloc[-1])


def readout(diagnostic: str, run_dir: Path) -> list[dict]:
    """The diagnostic's metrics and flag for the run in `run_dir`: [{metric, value, flag}, ...] (flag: the
    run's flag, the same on each of its rows)."""
    import pandas as pd

    from marlflow.analysis.curves import summarize_runs
    from marlflow.analysis.failures import failure_signatures
    from marlflow.analysis.gradients import grad_dynamics
    from marlflow.analysis.paired import paired_cliffs
    from marlflow.store.schema import with_build

    m = metrics(run_dir)
    if diagnostic in ("cliff", "cliff_paired", "collapse", "stagnation", "capture"):
        summary = summarize_runs(m)
        s = summary.iloc[0]
        if diagnostic == "cliff_paired":
            outcomes = with_build(pd.read_parquet(Path(run_dir) / "outcomes.parquet"))
            c = paired_cliffs(outcomes, summary).iloc[0]
            values, flag = {"drop": c["drop"], "p": c["p"]}, c["cliff_paired"]
        else:
            flag = failure_signatures(m, summary)[diagnostic].iloc[0]
        if diagnostic == "cliff":
            values = {"drop": s["drop"]}
        elif diagnostic == "collapse":
            values = {"base_minus_terminal3": s["base"] - s["terminal_mean3"]}
        elif diagnostic == "stagnation":
            values = {"peak_minus_base": s["peak"] - s["base"]}
        elif diagnostic == "capture":
            f0, f1 = _role_eval(m, "aggregator", "format_failure_rate")
            m0, m1 = _role_eval(m, "aggregator", "solution_marker_share")
            l0, l1 = _role_eval(m, "aggregator", "completion_length")
            values = {
                "format_failure_rise": f1 - f0,
                "solution_marker_rise": m1 - m0,
                "length_ratio": l1 / l0,
            }
    elif diagnostic in ("amplification", "cross_role"):
        g = grad_dynamics(m).set_index("role")
        if diagnostic == "amplification":
            value = g.loc["generator", "slot_amplification_mean"]
            values = {"slot_amplification": value, "slot_cos": g.loc["generator", "slot_cos_mean"]}
            flag = value >= AMPLIFICATION_FLAG
        else:
            value = g.loc["generator", "cos_others_mean"]
            values, flag = {"cos_others": value}, value >= COSINE_FLAG
    else:
        raise KeyError(f"unknown diagnostic {diagnostic!r}; known: {', '.join(CASES)}")
    return [{"metric": k, "value": float(v), "flag": bool(flag)} for k, v in values.items()]
