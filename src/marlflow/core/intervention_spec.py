"""What the rest of marlflow knows about an intervention kind: one frozen `InterventionSpec` per kind, the
registry that finds them, and `check_intervention`, which RunConfig runs on every intervention definition.

An intervention is a value of the matrix's `intervention` axis: a preset's `interventions:` block in
matrix.yaml maps a name to a kind and its parameters (`coh: {kind: coherence, lam: 0.3, window: 128}`), and
RunConfig checks the definition against its kind's spec (parameters, their types and ranges, the sharing
and workflow it needs) and fills in the defaults. What a kind does is the class its spec's `hooks` names (a
`marlflow.interventions.Intervention`); it is imported only when a trainer builds it, so checking a config
imports no torch.

    from marlflow.core.intervention_spec import kinds, spec_of
    kinds()                                # ("none", "kl_anchor", "coherence", ...)
    spec_of("coherence").params["lam"]     # Param(type="float", bounds={...}, default=0.3, help=...)

Adding an intervention: write its hooks class (one module; marlflow.interventions says which hooks there
are) and its spec. A kind shipped with marlflow puts its spec in BUILTIN below and its module in
src/marlflow/interventions/; one that lives outside the package defines `SPEC = InterventionSpec(...)` in
its module and names the module in the environment variable MARLFLOW_INTERVENTIONS (comma-separated
importable module names, read by every process, so Snakemake's train jobs see it too) or calls
`register(SPEC)` in the process that uses it. tests/interventions_extra/role_gain.py is such an
intervention; tests/test_interventions_train.py trains a step with it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from marlflow.core.registry import env_modules, load_spec
from marlflow.core.workflow_spec import spec_of as workflow_spec
from marlflow.core.workflow_spec import specs as workflow_specs

# Comma-separated importable modules with a SPEC each, registered after the built-in kinds.
ENV_VAR = "MARLFLOW_INTERVENTIONS"
NAME = re.compile(r"[a-z][a-z0-9_]*")
PARAM_TYPES = ("int", "float", "roles")
# The RunConfig.sharing values an intervention may run under (marlflow.core.config.SHARINGS but 'agent'; config
# imports this module, not the reverse). Under 'agent' a role's calls are spread over several adapters, and no
# intervention has been calibrated there, so check_intervention refuses every kind but none for it.
SHARINGS = ("sp", "ip")
_LOWER, _UPPER = ("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")


def _short(v, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def _inside(typ: str, bounds: Mapping[str, float], x) -> bool:
    """Is x a number of type `typ` ("int": an int, not a bool; else any finite int or float) within bounds?"""
    ok = isinstance(x, int) and not isinstance(x, bool) if typ == "int" else (
        isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x))  # fmt: skip
    lo = bounds.get("minimum", bounds.get("exclusiveMinimum"))
    hi = bounds.get("maximum", bounds.get("exclusiveMaximum"))
    return (
        ok and (x >= lo if "minimum" in bounds else x > lo) and (x <= hi if "maximum" in bounds else x < hi)
    )


class InterventionError(ValueError):
    """An invalid InterventionSpec, a spec module that cannot be loaded, or an unknown kind."""


@dataclass(frozen=True)
class Param:
    """One parameter of an intervention kind, as a preset's definition gives it."""

    type: str = field(
        metadata={"help": "int, float, or roles: a mapping role type -> number, each number within bounds"}
    )
    bounds: Mapping[str, float] = field(
        metadata={"help": "JSON-schema bounds: minimum or exclusiveMinimum, and maximum or exclusiveMaximum"}
    )
    default: object = field(
        default=None, metadata={"help": "the value when the definition omits it; None: required"}
    )
    help: str = field(default="", metadata={"help": "what the parameter does, in one line"})

    def __post_init__(self):
        if self.type not in PARAM_TYPES:
            raise InterventionError(f"Param type {self.type!r} is not one of {PARAM_TYPES}")
        keys = set(self.bounds)
        if not (len(keys & set(_LOWER)) == 1 and len(keys & set(_UPPER)) == 1 and keys <= {*_LOWER, *_UPPER}):
            raise InterventionError(f"Param bounds {dict(self.bounds)!r} must give one lower bound "
                                    f"({' or '.join(_LOWER)}) and one upper ({' or '.join(_UPPER)})")  # fmt: skip
        if (
            self.default is not None
            and self.type != "roles"
            and not _inside(self.type, self.bounds, self.default)
        ):
            raise InterventionError(
                f"Param default {self.default!r} is outside its bounds {dict(self.bounds)!r}"
            )


@dataclass(frozen=True)
class InterventionSpec:
    """Everything outside an intervention's module may know about its kind: what RunConfig validates, the
    matrix schema lists and the trainer builds."""

    name: str = field(metadata={"help": "the kind, as a definition's `kind:` names it (NAME)"})
    help: str = field(metadata={"help": "what it does, in one line"})
    hooks: str = field(
        metadata={
            "help": "'module:Class', the marlflow.interventions.Intervention subclass with the kind's hooks, "
            "imported when a trainer builds it (marlflow.interventions.build)"
        }
    )
    params: Mapping[str, Param] = field(
        default_factory=dict,
        metadata={"help": "parameter name -> Param, in the order config.json lists them"},
    )
    sharings: tuple[str, ...] = field(
        default=SHARINGS, metadata={"help": "the RunConfig.sharing values it runs under (SHARINGS: both)"}
    )
    sharing_note: str = field(
        default="",
        metadata={
            "help": "why it needs `sharings`, completing the refusal '<intervention> (<kind>) <note>. Exclude it "
            "for <sharing> cells'; required when sharings is not every sharing"
        },
    )
    validation_note: str = field(
        default="",
        metadata={
            "help": "non-empty: it selects weights on evaluations, so a run needs validation problems "
            "(task.val_size >= 1); the reason, completing '<intervention> (<kind>) <note>, so it must select "
            "on validation problems'"
        },
    )
    needs_parallel_role: bool = field(
        default=False,
        metadata={"help": "it acts on parallel same-role calls, so the workflow needs a parallel_role"},
    )

    def __post_init__(self):
        where = f"InterventionSpec {self.name!r}"

        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise InterventionError(f"{where}: {msg}")

        check(isinstance(self.name, str) and NAME.fullmatch(self.name) is not None,
              "name must be lower case letters, digits and underscores, starting with a letter")  # fmt: skip
        check(bool(self.help), "help is empty; say what it does in one line")
        check(isinstance(self.hooks, str) and re.fullmatch(r"[\w.]+:\w+", self.hooks) is not None,
              f"hooks must be 'module:Class', not {self.hooks!r}")  # fmt: skip
        check(all(isinstance(p, Param) for p in self.params.values()), "params must map names to Param")
        check("kind" not in self.params, "'kind' names the kind; it cannot be a parameter")
        check(bool(self.sharings) and set(self.sharings) <= set(SHARINGS),
              f"sharings must be some of {SHARINGS}, not {self.sharings!r}")  # fmt: skip
        check(set(self.sharings) == set(SHARINGS) or bool(self.sharing_note),
              "sharings leaves a sharing out; say why in sharing_note")  # fmt: skip


# The kinds shipped with marlflow, in the order the schema and the messages list them; each one's hooks are
# in marlflow.interventions.<name>, whose docstring says what it does and why.
BUILTIN = (
    InterventionSpec(
        name="none",
        help="no intervention",
        hooks="marlflow.interventions.common:NoIntervention",
    ),
    InterventionSpec(
        name="kl_anchor",  # I1
        help="the paper's I1: a per-role KL coefficient added to grpo.beta on that role's loss",
        hooks="marlflow.interventions.kl_anchor:KLAnchor",
        params={
            "beta": Param(
                "roles",
                {"minimum": 0, "maximum": 100},
                None,
                "role type -> its KL coefficient, e.g. {aggregator: 0.05}, on top of grpo.beta",
            ),
        },
    ),
    InterventionSpec(
        name="coherence",  # I6 (paper defaults: window 128, lam <= 0.3)
        help="the paper's I6: a role's gradient x 1 - lam * max(0, cos(g, EMA of its past gradients))",
        hooks="marlflow.interventions.coherence:Coherence",
        params={
            "lam": Param(
                "float",
                {"exclusiveMinimum": 0, "maximum": 1},
                0.3,
                "the share of a role's gradient removed at cosine 1 with its EMA",
            ),
            "window": Param(
                "int",
                {"minimum": 1, "maximum": 1_000_000},
                128,
                "W of the EMA of each role's own-loss gradient (weight 1/W per step)",
            ),
        },
    ),
    InterventionSpec(
        name="same_role_norm",
        help="a role's m parallel same-role calls (Voting's generators, Orch-Workers' workers) weigh as one",
        hooks="marlflow.interventions.same_role_norm:SameRoleNorm",
        needs_parallel_role=True,
    ),
    InterventionSpec(
        name="mass_balance",
        help="SP: no role's projection share of the shared update exceeds cap",
        hooks="marlflow.interventions.mass_balance:MassBalance",
        params={
            "cap": Param(
                "float",
                {"exclusiveMinimum": 0, "maximum": 1},
                0.6,
                "the largest projection share a role may have (raised to 1/n for n roles)",
            ),
        },
        sharings=("sp",),
        sharing_note="acts on the roles sharing one adapter, so it needs sharing sp; under ip each adapter "
        "has one role",
    ),
    InterventionSpec(
        name="cliff_guard",  # window, alpha: core.definitions' TERMINAL_WINDOW, ALPHA (a test checks)
        help="after an eval, on a calibrated cliff: back to the best eval's weights, learning rate x lr_factor",
        hooks="marlflow.interventions.cliff_guard:CliffGuard",
        params={
            "max_restores": Param("int", {"minimum": 1, "maximum": 1000}, 2, "restores per run at most"),
            "lr_factor": Param(
                "float",
                {"exclusiveMinimum": 0, "maximum": 1},
                0.5,
                "each restore multiplies every learning rate and its schedule by it",
            ),
            "window": Param(
                "int",
                {"minimum": 1, "maximum": 1000},
                3,
                "evals after a candidate peak that the cliff test averages",
            ),
            "alpha": Param(
                "float",
                {"exclusiveMinimum": 0, "maximum": 0.5},
                0.04,
                "the chance that a flat run is ever restored (split over the run's evals)",
            ),
        },
        validation_note="restores the best evaluation's weights",
    ),
)
_REGISTERED: dict[str, InterventionSpec] = {}


def register(spec: InterventionSpec) -> InterventionSpec:
    """Add an intervention kind defined outside marlflow to this process's registry (returns it). A different
    spec under a known kind is refused: two interventions would answer to one name."""
    if not isinstance(spec, InterventionSpec):
        raise InterventionError(f"register() takes an InterventionSpec, not {type(spec).__name__}")
    known = _REGISTERED.get(spec.name) or next((s for s in BUILTIN if s.name == spec.name), None)
    if known is not None and known is not spec:
        raise InterventionError(
            f"intervention kind {spec.name!r} is already registered; give it another name"
        )
    _REGISTERED[spec.name] = spec
    return spec


def specs() -> dict[str, InterventionSpec]:
    """Every known kind, name -> spec: BUILTIN in order, then those named in MARLFLOW_INTERVENTIONS, then those
    given to register()."""
    out = {s.name: s for s in BUILTIN}
    for mod in env_modules(ENV_VAR):
        register(load_spec(mod, InterventionSpec, ENV_VAR, InterventionError))
    out.update(_REGISTERED)
    return out


def kinds() -> tuple[str, ...]:
    """Every known kind, 'none' first."""
    return tuple(specs())


def spec_of(kind: str) -> InterventionSpec:
    """The spec of intervention kind `kind`; InterventionError naming the known ones if there is none."""
    known = specs()
    if kind not in known:
        raise InterventionError(f"intervention kind {kind!r} is unknown; choose one of {tuple(known)} (one "
                                f"outside marlflow: name its module in {ENV_VAR})")  # fmt: skip
    return known[kind]


# ---------------------------------------------------------------- a definition, checked


def check_intervention(cfg, check: Callable[[bool, str], None]) -> dict:
    """cfg.intervention_spec checked against its kind's InterventionSpec and cfg's workflow and sharing, with
    defaults filled in. The name `cfg.intervention` is 'none' exactly when the kind is.

    check: `check(cond, message)` raises the caller's error with `message` when cond is false (RunConfig
    passes its own, which raises ConfigError)."""
    name, spec = cfg.intervention, cfg.intervention_spec
    where = f"intervention {name!r}"
    check(isinstance(name, str) and name.replace("_", "a").isalnum() and name[:1].isalpha() and name.islower(),
          f"{where}: a name is lower-case letters, digits and '_', starting with a letter")  # fmt: skip
    check(
        isinstance(spec, dict), f"{where}: its definition must be a mapping with a kind, not {_short(spec)}"
    )
    kind, known = spec.get("kind"), specs()
    check(kind in known, f"{where}: kind {_short(kind)} is unknown; kinds: "
          f"{', '.join(k for k in known if k != 'none')}")  # fmt: skip
    check((name == "none") == (kind == "none"),
          f"{where} has kind {kind!r}: the name 'none' is reserved for no intervention, and only for it")  # fmt: skip
    ks = known[kind]
    out = {"kind": kind, **_checked_params(where, ks, spec, check)}
    check(kind == "none" or cfg.sharing != "agent",
          f"{where} ({kind}) acts on role gradients within one adapter, and under sharing 'agent' the parallel "
          "role's calls are spread over one adapter per agent, where no intervention is calibrated. Exclude it "
          "for agent cells (presets.<name>.exclude)")  # fmt: skip
    check(kind == "none" or cfg.sharing in ks.sharings,
          f"{where} ({kind}) {ks.sharing_note}. Exclude it for {cfg.sharing} cells (presets.<name>.exclude)")  # fmt: skip
    check(not (ks.validation_note and cfg.task.val_size < 1),
          f"{where} ({kind}) {ks.validation_note}, so it must select on validation problems, never the test "
          "problems it is reported on: set task.val_size >= 1 (e.g. `tasks: {math: {val_size: 64}}` in "
          "matrix.yaml)")  # fmt: skip
    parallel = [n for n, s in workflow_specs().items() if s.parallel_role]
    check(not (ks.needs_parallel_role and workflow_spec(cfg.workflow).parallel_role is None),
          f"{where} ({kind}) needs parallel same-role calls ({', '.join(parallel)}); workflow "
          f"{cfg.workflow!r} has none")  # fmt: skip
    return out


def _checked_params(where: str, ks: InterventionSpec, spec: dict, check: Callable[[bool, str], None]) -> dict:
    """The definition's parameters, each checked against its Param, defaults filled in, in ks.params order."""
    kind, params = ks.name, ks.params
    unknown = sorted(set(spec) - {"kind", *params})
    check(not unknown, f"{where} ({kind}): {unknown[0] if unknown else ''!s} is not a parameter; "
          f"allowed: {', '.join(params) or 'none'}")  # fmt: skip
    out = {}
    for p, prm in params.items():
        typ, bounds = prm.type, prm.bounds
        v = spec.get(p, prm.default)
        check(v is not None, f"{where} ({kind}): {p} is required")
        values = v if typ == "roles" else {p: v}
        if typ == "roles":
            check(isinstance(v, dict) and v, f"{where} ({kind}): {p} must map role types to numbers, "
                  f"e.g. {{aggregator: 0.05}}, not {_short(v)}")  # fmt: skip
            roles = {r for s in workflow_specs().values() for r in s.role_types}
            bad = sorted(set(v) - roles)
            check(not bad, f"{where} ({kind}): {bad[0] if bad else ''} is not a role type; role types: "
                  f"{', '.join(sorted(roles))}")  # fmt: skip
        for k, x in values.items():
            lo = bounds.get("minimum", bounds.get("exclusiveMinimum"))
            hi = bounds.get("maximum", bounds.get("exclusiveMaximum"))
            rng = (
                f"{'>=' if 'minimum' in bounds else '>'} {lo} and {'<=' if 'maximum' in bounds else '<'} {hi}"
            )
            check(_inside(typ, bounds, x), f"{where} ({kind}): {p}{'.' + k if typ == 'roles' else ''} is "
                  f"{_short(x)}; it must be {'an integer' if typ == 'int' else 'a number'} {rng}")  # fmt: skip
        out[p] = v
    return out
