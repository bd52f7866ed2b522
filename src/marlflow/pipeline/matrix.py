"""matrix.yaml -> run sheet: one row per training run, validated up front.

The experiment design lives in `matrix.yaml` as presets (toy, smol, paper, ...). A preset lists the axes
(AXES: workflow x sharing x scale x task x seed x build x intervention), maps each task and scale to a dataset
and a model, and sets GRPO and run-level settings, with optional per-cell `overrides`. Expanding a preset
builds one `RunConfig` per cell, so every invalid value fails here, before Snakemake schedules anything, with
one paragraph that names the key path and the fix.

    python -m marlflow matrix matrix.yaml                  # validate, print the default preset's run sheet
    python -m marlflow matrix matrix.yaml --preset paper --json

A run id names the run's folder, so it must mean one run across all presets: `check_run_ids` (run by this
command and by the Snakefile) rejects two presets that train one id differently; a preset's `tag:` keeps
their ids apart (toy_long's runs are `...-s0-long`).

The file is read defensively, since a matrix file may come from anywhere: at most MAX_FILE_BYTES, strict
UTF-8, YAML with duplicate keys rejected, nesting at most MAX_DEPTH deep and at most MAX_NODES values after
alias expansion (a 5 KB "billion laughs" file fails in milliseconds), every mapping key a string, every
number finite and within its field's bounds (marlflow.core.config.bounds_of), task names checked against the
registry and each task's kind against the task axis value it is listed under.
Every failure is a MatrixError: one paragraph of at most MAX_MESSAGE characters, exit status 2.

    from marlflow.pipeline.matrix import run_sheet
    sheet = run_sheet("matrix.yaml", preset="toy", overrides={"workflow": ["voting"]})

Interventions (marlflow.interventions) are axis values too: `intervention: [none, coh]` with the name `coh`
defined in the preset's `interventions:` block (`coh: {kind: coherence, lam: 0.3, window: 128}`); the
run id gets `-coh` and the run config carries the definition as `intervention_spec`.

`build` is the toy model's build seed (toy scales only, config.TOY_SCALES; default [0], the shipped model):
build b > 0 trains from a toy model built here with `--seed b` into `<models.<scale>>-b<b>`
(results/models/toy-b1, results/models/toy2-b1, ...), and the run id gets `-b<b>` after the seed. The seed
axis varies training and evaluation sampling around one model; the build axis varies the model itself (its
weights also depend on the CPU: docs/results.md). (seed, build) pairs are treated as exchangeable replicates:
with two builds an interval speaks for those builds, not a new one.
    RunConfig.from_dict(json.loads(sheet.loc["voting-ip-toy-math-s0", "config"]))
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import difflib
import itertools
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jsonschema
import pandas as pd
import yaml

from marlflow.core import config as C
from marlflow.core.config import ConfigError, GRPOParams, RunConfig, TaskSpec
from marlflow.core.intervention_spec import kinds as intervention_kinds
from marlflow.core.workflow_spec import spec_of, workflow_names

MAX_FILE_BYTES = 1_000_000  # matrix.yaml is ~7 KB
MAX_DEPTH = 32  # nesting of mappings/lists; matrix.yaml needs 6
MAX_NODES = 100_000  # values after alias expansion
MAX_RUNS = 100_000  # cells a preset may expand to
MAX_MESSAGE = 2000  # characters of one error message

NAME_PATTERN = "^[a-z][a-z0-9_]*$"  # a name the matrix defines itself (an intervention's)


@dataclass(frozen=True)
class Axis:
    """One axis of the matrix. Its entry in AXES is all the matrix code knows of it: the schema of a preset's
    `axes:`, `when:` and `exclude:`, the --config restriction and its plural, the defaults, the run sheet's
    column and the RunConfig field a cell's value goes to are all made from it.

    name: the key under a preset's `axes:` / `when:` / `exclude:`, the run sheet's column, a --config key and
        the metrics' factor column (marlflow.store.schema.FACTOR_COLUMNS, in this order after run_id).
    field: the RunConfig field holding the value; its metadata names the axis (`axis=name`).
    help: what the axis varies.
    plural: another spelling accepted as a --config key, e.g. workflows=[voting] ("": none).
    values: the allowed values where the field has no enum of its own (workflows: the registry); None with
        neither: integers within the field's bounds (seed, build), or names the preset defines (intervention).
    default: the values of a preset that does not list the axis; () = the axis is required.
    table: the preset mapping that needs an entry per value (`tasks`, `models`), with the schema of an entry.
    """

    name: str
    field: str
    help: str
    plural: str = ""
    values: Callable[[], Sequence] | None = None
    default: tuple = ()
    table: str = ""
    table_entry: dict | None = None

    def allowed(self) -> tuple | None:
        """The values a preset may list, None where they are integers or the preset's own names."""
        if self.values is not None:
            return tuple(self.values())
        enum = C.enum_of(RunConfig, self.field)
        return tuple(enum) if enum is not None else None

    @property
    def integer(self) -> bool:
        return str({f.name: f for f in dataclasses.fields(RunConfig)}[self.field].type) == "int"

    def item_schema(self) -> dict:
        """The JSON schema of one value of the axis."""
        if self.integer:
            return {"type": "integer", **C.bounds_of(RunConfig)[self.field]}
        allowed = self.allowed()
        return {"enum": list(allowed)} if allowed is not None else {"type": "string", "pattern": NAME_PATTERN}


# The axes, in the order of the run sheet's and the metrics' columns. Adding one: tests/test_config_fields.py,
# test_a_new_axis, shows every place that must change and checks the lists kept elsewhere against this one.
AXES = {
    a.name: a
    for a in (
        Axis("workflow", "workflow", "the multi-agent workflow", "workflows", values=workflow_names),
        Axis("sharing", "sharing", "one adapter for all roles (sp), one per role type (ip) or one per agent "
             "instance (agent: each parallel slot its own)"),
        Axis("scale", "scale", "the model size", "scales", table="models",
             table_entry={"type": "string", "minLength": 1}),
        Axis("task", "task_axis", "the task kind: math or code", "tasks", table="tasks",
             table_entry={"$ref": "#/$defs/task"}),
        Axis("seed", "seed", "the sampling seed of training and evaluation", "seeds", default=(0,)),
        Axis("build", "build", "the toy model's build seed; 0 = the shipped toy model", "builds", default=(0,)),
        Axis("intervention", "intervention", "the intervention, a name defined in the preset's interventions "
             "block; none = no intervention", "interventions", default=("none",)),
    )
}  # fmt: skip
INT_AXES = tuple(a.name for a in AXES.values() if a.integer)
# Plural spellings accepted as overrides, e.g. `snakemake --config workflows=[voting] tasks=[math]`.
ALIASES = {a.plural: a.name for a in AXES.values() if a.plural}
SHEET_COLUMNS = [*AXES, "preset", "model", "config"]
JSON_TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "dict": "object",
              "list": "array"}  # fmt: skip
# JSON schema counts 40.0 as an integer; a config field typed int must get an int.
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, v: isinstance(v, int) and not isinstance(v, bool)
    ),
)


class MatrixError(ValueError):
    """An invalid matrix file, preset or override; the message is one paragraph naming the key path."""


def _fields_schema(cls, skip=()) -> dict:
    """The JSON schema of the fields of config class `cls` but `skip`: type, help, bounds and enum from each
    field's metadata (marlflow.core.config)."""
    # Field types are strings ("int", "float") because config.py uses `from __future__ import annotations`.
    out = {}
    bounds = C.bounds_of(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        out[f.name] = {
            "type": JSON_TYPES[str(f.type)],
            "description": C.help_of(cls, f.name),
            **bounds.get(f.name, {}),
        }
        enum = C.enum_of(cls, f.name)
        if enum is not None:
            enum = {"enum": list(enum)}
            if out[f.name]["type"] == "array":  # a list of distinct enum values (report_to)
                enum = {"items": {"type": "string", **enum}, "uniqueItems": True}
            out[f.name].update(enum)
    return out


def schema() -> dict:
    """The JSON schema of matrix.yaml: matrix_schema.json's structure, with the axes (AXES) and the fields of
    task / grpo / run (their metadata in marlflow.core.config) filled in."""
    s = json.loads(resources.files("marlflow.pipeline").joinpath("matrix_schema.json").read_text())
    d = s["$defs"]
    for a in AXES.values():
        d[a.field] = a.item_schema()  # one value of the axis, named by its RunConfig field
        ref = {"$ref": f"#/$defs/{a.field}"}
        d["axes"]["properties"][a.name] = {"description": a.help, "type": "array", "minItems": 1,
                                           "uniqueItems": True, "items": ref}  # fmt: skip
        d["when"]["properties"][a.name] = {"type": "array", "minItems": 1, "items": ref}
        if a.table:
            d["preset"]["properties"][a.table]["properties"] = {v: a.table_entry for v in a.allowed()}
    d["intervention_def"]["properties"]["kind"]["enum"] = list(intervention_kinds())
    d["intervention_analysis"]["properties"]["pair_by"]["items"]["enum"] = [
        a for a in AXES if a != "intervention"
    ]
    d["task"]["properties"] = _fields_schema(TaskSpec)
    d["grpo"]["properties"] = _fields_schema(GRPOParams)
    d["run"]["properties"] = _fields_schema(RunConfig, skip=C.fields_with(RunConfig, "not_run_level"))
    return s


def _keypath(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _did_you_mean(word, options) -> str:
    hit = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.5)
    return f" Did you mean {hit[0]!r}?" if hit else ""


def _describe(err: jsonschema.ValidationError) -> str:
    """One sentence for one schema violation: where, what was found, what is allowed."""
    path, v, sch = _keypath(err.absolute_path), err.instance, err.schema
    if err.validator == "additionalProperties":
        allowed = list(sch.get("properties", {}))
        patterns = list(sch.get("patternProperties", {}))
        extra = [k for k in v if k not in allowed and not any(re.search(p, k) for p in patterns)]
        if patterns:
            return (
                f"{path} has an invalid name {_short(extra[0])}: a name starts with a lower-case letter "
                "and has only lower-case letters, digits and '_'."
            )
        where = _keypath([*err.absolute_path, str(extra[0])[:60]])
        return (
            f"{where} is not a known key.{_did_you_mean(extra[0], allowed)} "
            f"Allowed keys under {path}: {', '.join(allowed)}."
        )
    if err.validator == "enum":
        return (
            f"{path} is {_short(v)}, which is not allowed.{_did_you_mean(v, err.validator_value)} "
            f"Allowed values: {', '.join(map(str, err.validator_value))}."
        )
    if err.validator == "type":
        hint = ""
        if err.validator_value == "number" and isinstance(v, str):
            hint = " (YAML reads 2e-3 as text; write 2.0e-3)"
        want = (
            err.validator_value if isinstance(err.validator_value, str) else " or ".join(err.validator_value)
        )
        want = {"array": "array (a YAML list)", "object": "object (a YAML mapping)"}.get(want, want)
        return f"{path} is {_short(v)} of type {type(v).__name__}, but it must be {want}{hint}."
    if err.validator == "minItems":
        return f"{path} is empty; list at least one value, or delete the key to inherit it."
    if err.validator == "uniqueItems":
        return f"{path} lists a value more than once: {_short(v)}."
    if err.validator == "required":
        return f"{path}: {_short(err.message, 300)}."
    if err.validator in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        rng = _range_words(sch)
        return f"{path} is {_short(v)}, which is out of range; allowed: {rng}."
    if err.validator in ("minLength", "minProperties"):
        return f"{path} is {_short(v)}, which is too small ({err.validator}: {err.validator_value})."
    return f"{path}: {_short(err.message, 300)}."


def _range_words(sch: dict) -> str:
    parts = []
    for key, op in (
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
    ):
        if key in sch:
            parts.append(f"{op} {sch[key]}")
    return " and ".join(parts)


def _short(v, n: int = 120) -> str:
    """repr(v), cut to n characters: a message quotes what it found without echoing a huge value."""
    r = repr(v)
    return r if len(r) <= n else f"{r[: n - 20]}... ({len(r)} characters)"


def _fail(where: str, msg: str):
    text = " ".join(f"{where}: {msg}".split())
    if len(text) > MAX_MESSAGE:
        text = text[: MAX_MESSAGE - 20] + " ... (cut)"
    raise MatrixError(text)


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and bounds nesting depth and alias expansion.

    PyYAML's composer recurses once per nesting level (deep brackets end in a RecursionError dump) and
    shares an aliased node instead of copying it, so a small file can stand for billions of values that
    any later walk (schema validation, deepcopy, an error message) expands. Depth is counted while
    composing; the expanded size is computed on the composed graph, memoised per node, before any
    Python object is built."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.MarkedYAMLError(
                    problem=f"values are nested more than {MAX_DEPTH} levels deep",
                    problem_mark=self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be text, not a list or mapping", key_node.start_mark
                ) from None
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {_short(key, 60)} (first at line {first.line + 1}); each key may "
                    "appear once per mapping, and with duplicates only the last would count",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root) -> int:
    """Values the node graph stands for once aliases are expanded; stops counting past MAX_NODES."""
    sizes: dict[int, int] = {}
    entered: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        kids = []
        if isinstance(node, yaml.SequenceNode):
            kids = node.value
        elif isinstance(node, yaml.MappingNode):
            kids = [n for kv in node.value for n in kv]
        if not done:
            # Depth-first: a node met again while its own subtree is still open is its own descendant,
            # a recursive alias (&a [*a]) that stands for an infinite value.
            if id(node) in entered:
                return MAX_NODES + 1
            entered.add(id(node))
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in sizes)
            continue
        sizes[id(node)] = min(MAX_NODES + 1, 1 + sum(sizes[id(k)] for k in kids))
    return sizes[id(root)]


def _read_yaml(path: Path, name: str):
    """The parsed matrix file, or MatrixError naming what is wrong with it."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        _fail(
            name,
            f"file not found: {Path(path).absolute()} does not exist. A relative path is looked up in the current "
            f"folder ({Path.cwd()}); run from the marlflow repository root, or pass the file's path "
            "(`marlflow matrix PATH/matrix.yaml`; Snakemake: `--config matrix=PATH/matrix.yaml`).",
        )
    except IsADirectoryError:
        _fail(name, "is a directory; pass the path of the matrix file itself (default matrix.yaml).")
    except OSError as err:
        _fail(name, f"cannot be read ({err.strerror or err}); check the path and its permissions.")
    if len(data) > MAX_FILE_BYTES:
        _fail(name, f"is larger than {MAX_FILE_BYTES:,} bytes; a matrix file is a few KB of YAML.")
    nul = data.find(b"\0")
    if nul >= 0:
        _fail(name, f"is a binary file (NUL byte at offset {nul}), not a YAML matrix file.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        _fail(name, f"is not UTF-8 text (byte 0x{data[err.start]:02x} at line {line}); save it as UTF-8.")
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node) > MAX_NODES:
            _fail(
                name,
                f"expands to more than {MAX_NODES:,} values through YAML aliases (*name); "
                "write the values out or use fewer aliases.",
            )
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        _fail(name, f"not valid YAML{where}: {_short(problem, 400)[1:-1]}.")
    except RecursionError:  # a cyclic alias graph that the size walk could not rule out
        _fail(name, f"is nested more than {MAX_DEPTH} levels deep.")
    finally:
        loader.dispose()


def _check_values(obj, parts=()) -> None:
    """Every mapping key is text and every number finite, named by its key path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                _fail_at(
                    parts,
                    f"has the key {k!r} of type {type(k).__name__}; keys must be text: quote it ('{k}'), "
                    "since YAML reads bare yes/no/on/off as booleans and digits as numbers.",
                )
            _check_values(v, (*parts, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_values(v, (*parts, i))
    elif isinstance(obj, float) and not math.isfinite(obj):
        _fail_at(parts, f"is {obj!r}; numbers must be finite (.inf and .nan are not allowed).")


def _fail_at(parts, msg: str):
    raise MatrixError(f"{_keypath(parts)} {msg}")


def load_matrix(path_or_dict) -> dict:
    """Read matrix.yaml (or take an already parsed dict) and validate it against the schema."""
    if isinstance(path_or_dict, dict):
        doc, name = copy.deepcopy(path_or_dict), "matrix"
    else:
        name = str(path_or_dict)
        doc = _read_yaml(Path(path_or_dict), name)
    if not isinstance(doc, dict):
        _fail(
            name,
            f"the file must be a mapping with keys default_preset and presets, not {type(doc).__name__}.",
        )
    try:
        _check_values(doc)
    except MatrixError as err:
        _fail(name, str(err))
    # A scalar where a list is expected (`seed: 0`, `when: {task: math}`) means a one-element list.
    presets = doc.get("presets")
    for preset in presets.values() if isinstance(presets, dict) else ():
        if isinstance(preset, dict):
            overrides = preset.get("overrides")
            exclude = preset.get("exclude")
            sections = (
                [preset.get("axes")]
                + [
                    o.get("when")
                    for o in (overrides if isinstance(overrides, list) else [])
                    if isinstance(o, dict)
                ]
                + [w for w in (exclude if isinstance(exclude, list) else [])]
            )
            for sec in sections:
                for k, val in (sec or {}).items() if isinstance(sec, dict) else ():
                    if k in AXES and isinstance(val, str | int) and not isinstance(val, bool):
                        sec[k] = [val]
    _trl_names_to_ours(doc, name)
    err = jsonschema.exceptions.best_match(_Validator(schema()).iter_errors(doc))
    if err is not None:
        _fail(name, _describe(err))
    if doc["default_preset"] not in doc["presets"]:
        _fail(f"{name}: default_preset", _unknown_preset(doc["default_preset"], doc))
    for p in doc["presets"]:
        resolve_preset(doc, p, name)
    return doc


def _trl_names_to_ours(doc: dict, name: str) -> None:
    """Rename TRL's / PEFT's names in every preset's `grpo:` (and its overrides') to marlflow's, in place
    (marlflow.core.config.TRL_NAMES: max_steps -> steps, num_generations -> group_size, ...)."""
    presets = doc.get("presets")
    for pname, preset in presets.items() if isinstance(presets, dict) else ():
        if not isinstance(preset, dict):
            continue
        overrides = preset.get("overrides") if isinstance(preset.get("overrides"), list) else []
        holders = [(f"presets.{pname}", preset)] + [
            (f"presets.{pname}.overrides[{i}]", o) for i, o in enumerate(overrides) if isinstance(o, dict)
        ]
        for where, holder in holders:
            if isinstance(holder.get("grpo"), dict):
                try:
                    holder["grpo"] = C.canonical_grpo_keys(holder["grpo"], f"{where}.grpo")
                except ConfigError as err:
                    _fail(name, str(err))


def _unknown_preset(preset, doc) -> str:
    names = list(doc["presets"])
    return f"{preset!r} is not a defined preset.{_did_you_mean(preset, names)} Defined presets: {', '.join(names)}."


def _merge(base: dict, top: dict) -> dict:
    """Deep merge: mappings merge key by key, anything else (lists included) is replaced."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _extends_chain(doc: dict, preset: str, name: str = "matrix") -> list[str]:
    """[preset, the preset it extends, that one's, ...]; MatrixError for a cycle or an unknown preset."""
    chain, p = [], preset
    while p is not None:
        if p in chain:
            _fail(f"{name}: presets.{preset}.extends", f"extends forms a cycle: {' -> '.join([*chain, p])}.")
        if p not in doc["presets"]:
            _fail(f"{name}: presets.{chain[-1]}.extends", _unknown_preset(p, doc))
        chain.append(p)
        p = doc["presets"][p].get("extends")
    return chain


def _written_in(doc: dict, preset: str, message: str, task_axis: str) -> tuple[str, str]:
    """(preset, section) where the setting a ConfigError `message` is about ("grpo.group_size is 1 ...") is
    written: the nearest preset up the extends chain of `preset` that sets it (in its section or an override),
    so that an error names the preset the user edited, not one that inherits it. Falls back to `preset` and
    every section."""
    m = re.match(r"(grpo|task)\.(\w+)", message) or re.match(r"()(\w+)", message)
    section, key = {"grpo": "grpo", "task": "tasks", "": "run"}[m[1]], m[2]
    for p in _extends_chain(doc, preset):
        body = doc["presets"][p]
        where = [body.get(section) or {}] + [o.get(section) or {} for o in body.get("overrides") or []]
        if section == "tasks":
            where = [w.get(task_axis) or {} for w in where[:1]]
        if any(isinstance(w, dict) and key in w for w in where):
            return p, section
    return preset, "grpo/run/tasks"  # not one setting written in one place (e.g. a combination)


def resolve_preset(doc: dict, preset: str, name: str = "matrix") -> dict:
    """The preset with its `extends` chain merged in, checked for completeness."""
    chain = _extends_chain(doc, preset, name)
    out = {}
    for p in reversed(chain):
        out = _merge(out, {k: v for k, v in doc["presets"][p].items() if k != "extends"})
    for key in ("axes", "tasks", "models", "grpo"):
        if key not in out:
            _fail(
                f"{name}: presets.{preset}.{key}", "is missing; every preset needs axes, tasks, models, grpo."
            )
    for a in AXES.values():
        if not a.default and a.name not in out["axes"]:
            _fail(f"{name}: presets.{preset}.axes.{a.name}", "is missing; list the values to run.")
    for a in AXES.values():
        if a.default:
            out["axes"].setdefault(a.name, list(a.default))
    defined = out.setdefault("interventions", {})
    if "none" in defined:
        _fail(
            f"{name}: presets.{preset}.interventions.none", "'none' means no intervention; pick another name."
        )
    for v in out["axes"]["intervention"]:
        if v != "none" and v not in defined:
            _fail(
                f"{name}: presets.{preset}.axes.intervention",
                f"lists {v!r}, which is not defined under presets.{preset}.interventions.{_did_you_mean(v, defined)} "
                f"Define it there (e.g. `{v}: {{kind: coherence, lam: 0.3, window: 128}}`; kinds: "
                f"{', '.join(intervention_kinds())}) or use one of: {', '.join(['none', *defined])}.",
            )
    _check_analysis(out, preset, name)
    for a in (a for a in AXES.values() if a.table):
        for v in out["axes"][a.name]:
            if v not in out[a.table]:
                _fail(
                    f"{name}: presets.{preset}.{a.table}",
                    f"has no entry for {a.name} {v!r} (listed in presets.{preset}.axes.{a.name}); "
                    f"add `{v}: ...` under presets.{preset}.{a.table} or drop {v!r} from the axis.",
                )
    _check_tasks(out["tasks"], chain, name)
    n_runs = math.prod(len(out["axes"][a]) for a in AXES)
    if n_runs > MAX_RUNS:
        _fail(f"{name}: presets.{preset}.axes", f"expands to {n_runs:,} runs, more than {MAX_RUNS:,}.")
    return out


def _check_tasks(tasks: dict, chain: list[str], name: str) -> None:
    """Each entry of a preset's `tasks:` (chain: the preset and those it extends) names a registered task of
    the entry's task kind (`marlflow.tasks.get_task(name).kind`, what RunConfig.task_axis must be). Raises
    MatrixError."""
    from marlflow.tasks import TASKS, _load_builtin, get_task

    _load_builtin()
    for kind, spec in tasks.items():
        where = f"{name}: presets.{chain[0]}.tasks.{kind}"
        if "name" not in spec:
            via = f" (nor in the presets it extends: {' -> '.join(chain[1:])})" if len(chain) > 1 else ""
            _fail(where, f"has no name{via}; add `name: ...`, one of: {', '.join(sorted(TASKS))}.")
        if spec["name"] not in TASKS:
            _fail(
                f"{where}.name",
                f"{_short(spec['name'])} is not a registered task.{_did_you_mean(spec['name'], TASKS)} "
                f"Registered tasks: {', '.join(sorted(TASKS))}.",
            )
        actual = get_task(spec["name"]).kind
        if actual != kind:
            same = sorted(t for t in TASKS if get_task(t).kind == kind)
            _fail(
                f"{where}.name",
                f"{_short(spec['name'])} is a {actual} task (marlflow.tasks.get_task({spec['name']!r}).kind is "
                f"{actual!r}), but the entry is the preset's {kind!r} task, whose runs prompt and are scored as "
                f"{kind} (RunConfig.task_axis). Move it under tasks.{actual}, or name a {kind} task: "
                f"{', '.join(same)}.",
            )


def _check_analysis(p: dict, preset: str, name: str) -> None:
    """The preset's declared analyses name what it runs: the pooled intervention table's baseline and
    compared interventions are values of its intervention axis (the baseline not among those compared), and
    its pairs share every axis the preset varies (else a pair would cross cells). Raises MatrixError."""
    ia = (p.get("analysis") or {}).get("interventions")
    if ia is None:
        return
    where = f"{name}: presets.{preset}.analysis.interventions"
    axis = p["axes"]["intervention"]
    baseline = ia.get("baseline", "none")
    for key, names in (("baseline", [baseline]), ("compare", ia["compare"])):
        for v in names:
            if v not in axis:
                _fail(
                    f"{where}.{key}",
                    f"names {v!r}, which is not on the preset's intervention axis "
                    f"({', '.join(axis)}).{_did_you_mean(v, axis)} Compare only what the preset runs: add it to "
                    f"presets.{preset}.axes.intervention or drop it here.",
                )
    if baseline in ia["compare"]:
        _fail(
            f"{where}.compare",
            f"lists the baseline {baseline!r}; an intervention is compared with it, not itself.",
        )
    varied = [a for a in AXES if a != "intervention" and len(p["axes"][a]) > 1]
    missing = [a for a in varied if a not in ia.get("pair_by", varied)]
    if missing:
        _fail(
            f"{where}.pair_by",
            f"leaves out {', '.join(missing)}, which the preset varies: a pair would join runs of different "
            f"{', '.join(missing)}. Add {', '.join(missing)} to pair_by.",
        )


def _apply_overrides(axes: dict, overrides: dict, interventions=("none",)) -> dict:
    """Restrict or replace axes from the command line, e.g. {"workflows": ["voting"], "seed": "1"}.
    interventions: the intervention names the preset defines ("none" included)."""
    axes = dict(axes)
    allowed = {a.name: a.allowed() for a in AXES.values()}
    allowed["intervention"] = tuple(interventions)
    for key, val in (overrides or {}).items():
        axis = ALIASES.get(key, key)
        if axis not in AXES:
            _fail(
                f"override {key}",
                f"is not an axis.{_did_you_mean(key, [*AXES, *ALIASES])} Overridable axes: {', '.join(AXES)} "
                "(plural spellings work too), e.g. --config preset=smol workflows=[voting] tasks=[math].",
            )
        vals = list(val) if isinstance(val, list | tuple) else [val]
        if not vals:
            _fail(f"override {key}", "is empty; list at least one value.")
        if axis in INT_AXES:
            lo, hi = (C.bounds_of(RunConfig)[AXES[axis].field][k] for k in ("minimum", "maximum"))
            many = AXES[axis].plural or axis
            try:
                vals = [int(v) for v in vals]
                if not all(lo <= v <= hi for v in vals):
                    raise ValueError
            except (TypeError, ValueError, OverflowError):
                _fail(
                    f"override {key}",
                    f"is {_short(val)}; {many} must be integers in {lo}..{hi}, e.g. {many}=[0,1,2].",
                )
        else:
            vals = [str(v) for v in vals]
            for v in vals:
                if allowed[axis] is not None and v not in allowed[axis]:
                    _fail(
                        f"override {key}",
                        f"{v!r} is not a known {axis}.{_did_you_mean(v, allowed[axis])} "
                        f"Allowed values: {', '.join(allowed[axis])}.",
                    )
        axes[axis] = list(dict.fromkeys(vals))
    return axes


def config_keys() -> dict[str, str]:
    """Snakemake config keys (--config, a profile's `config:` / `configfiles:`) the Snakefile reads, with what
    each is for: every axis and its plural among them. Anything else is a typo that Snakemake itself would
    ignore in silence."""
    return {
        "matrix": "the matrix file (default matrix.yaml)",
        "preset": "the preset to run (default: the matrix's default_preset)",
        "scale_resources": "per-scale GPUs, memory and time (a profile's config)",
        "toy_build": "options of the toy model build, e.g. --build",
        "report_to": "experiment trackers for the runs that train now, e.g. [tensorboard] (retrains nothing)",
        **{a: "restrict this axis" for a in (*AXES, *ALIASES)},
    }


def check_config_keys(config: dict) -> None:
    """Raise MatrixError for a Snakemake config key the Snakefile does not read (e.g. `wrkflows=[voting]`,
    `learning_rate=0.001`), naming the closest known key, or where a training setting goes instead."""
    known = config_keys()
    not_run_level = C.fields_with(RunConfig, "not_run_level")
    for key in config:
        if key in known:
            continue
        fields = {f.name: "grpo" for f in dataclasses.fields(GRPOParams)}
        fields.update({f.name: "run" for f in dataclasses.fields(RunConfig) if f.name not in not_run_level})
        ours = {trl: f for f, trl in C.TRL_NAMES.items()}.get(key, key)
        trl = f" ({key} is TRL's name for it)" if ours != key else ""
        hint = (
            f" {key} is a training setting{trl}: set it in matrix.yaml under presets.<preset>.{fields[ours]}."
            f"{ours} (or in a new preset that extends yours)."
            if ours in fields
            else _did_you_mean(key, known)
        )
        _fail(
            "--config",
            f"{key!r} is not a config key marlflow reads, so it would be ignored.{hint} Known keys: "
            f"{', '.join(known)}, e.g. --config preset=smol workflows=[voting] tasks=[math].",
        )


def _matches(when: dict, cell: dict) -> bool:
    return all(cell[k] in v for k, v in when.items())


def run_id(workflow: str, sharing: str, scale: str, task: str, seed: int, intervention: str = "none",
           tag: str = "", build: int = 0) -> str:  # fmt: skip
    """`{workflow}-{sharing}-{scale}-{task}-s{seed}`, then `-b{build}` unless 0, `-{tag}` (the preset's `tag:`)
    and `-{intervention}` unless empty / none. The run's folder is results/runs/<run id>."""
    rid = (
        f"{workflow}-{sharing}-{scale}-{task}-s{seed}"
        + (f"-b{build}" if build else "")
        + (f"-{tag}" if tag else "")
    )
    return (rid if intervention == "none" else f"{rid}-{intervention}").lower()


def check_run_ids(path_or_dict) -> None:
    """Raise MatrixError if one run id would mean two different runs in two presets.

    A run's folder is named by its id, so two presets that train the same cell differently (toy_long's 120
    steps against toy's 40) would overwrite each other's results, and a rerun would resume one from the
    other's checkpoints. Presets may share a run only when its config differs at most in fields flagged
    provenance (marlflow.core.config; toy_seeds' seed 0 is toy's run). The fix is a `tag:` on one of them."""
    doc = load_matrix(path_or_dict)
    name = "matrix" if isinstance(path_or_dict, dict) else str(path_or_dict)
    seen: dict[str, tuple[str, dict]] = {}
    for preset in doc["presets"]:
        try:
            sheet = run_sheet(doc, preset)
        except MatrixError:
            continue  # a preset that does not expand cannot be run, so it cannot take a folder either
        for rid, cfg_json in sheet["config"].items():
            cfg = json.loads(cfg_json)
            first = seen.setdefault(rid, (preset, cfg))
            if C.config_fingerprint(first[1]) != C.config_fingerprint(cfg):
                diff = "; ".join(C.config_differences(first[1], cfg, limit=3))
                _fail(
                    f"{name}: presets.{first[0]} and presets.{preset}",
                    f"both expand to run {rid!r} but train it differently ({diff}), so they would write the "
                    f"same folder results/runs/{rid}/ and one would overwrite the other's results. Give one of "
                    f"them (or a preset it extends) its own `tag:`, e.g. `tag: {preset[:24]}`, which is "
                    "appended to its run ids.",
                )


def jobs_use_this_python() -> None:
    """Put the running interpreter's venv first on PATH, for the Snakefile's jobs (`python -m marlflow.<verb>`).

    `.venv/bin/snakemake ...` without activating the venv would otherwise give the jobs whatever `python`
    comes first on PATH, which has no marlflow. Outside a venv nothing changes; a `--use-conda` env is put
    first by Snakemake itself for its jobs.
    """
    if sys.prefix != sys.base_prefix:
        bin_dir = str(Path(sys.executable).parent)
        path = os.environ.get("PATH", "")
        if path.split(os.pathsep)[0] != bin_dir:
            os.environ["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir


def _selected(path_or_dict, preset: str | None, overrides: dict | None):
    """(doc, file name, preset name, resolved preset, axes after --config overrides). Raises MatrixError."""
    doc = load_matrix(path_or_dict)
    name = "matrix" if isinstance(path_or_dict, dict) else str(path_or_dict)
    preset = preset or doc["default_preset"]
    if preset not in doc["presets"]:
        _fail(f"{name}: preset", _unknown_preset(preset, doc))
    p = resolve_preset(doc, preset, name)
    return doc, name, preset, p, _apply_overrides(p["axes"], overrides, ["none", *p["interventions"]])


def analysis_of(path_or_dict, preset: str | None = None) -> dict:
    """The preset's declared analyses (its `analysis:` block, after `extends`), {} when it declares none.
    Read by rules/aggregate.smk, which hands them to marlflow.analysis.aggregate. Raises MatrixError."""
    return _selected(path_or_dict, preset, None)[3].get("analysis") or {}


def model_of(model: str, build: int) -> str:
    """The model a run of toy build `build` trains from: the preset's model, or `<model>-b<build>` for b > 0.
    The Snakefile names model folders the same way (results/models/<scale>[-b<build>])."""
    return f"{model}-b{build}" if build else model


def only_overrides(items: list[str]) -> dict[str, list[str]]:
    """`--only AXIS=V1,V2 ...` (marlflow matrix, marlflow plan) as run_sheet's overrides: axis -> values."""
    out = {}
    for item in items:
        key, _, vals = item.partition("=")
        out[key] = vals.split(",") if vals else []
    return out


def run_sheet(path_or_dict, preset: str | None = None, overrides: dict | None = None) -> pd.DataFrame:
    """Expand one preset into a DataFrame indexed by run_id (columns: SHEET_COLUMNS).

    `config` holds the JSON of `RunConfig.to_dict()`; building the RunConfig here means every invalid
    value is caught at expansion time. Raises MatrixError.
    """
    doc, name, preset, p, axes = _selected(path_or_dict, preset, overrides)
    for a in (a for a in AXES.values() if a.table):
        for v in axes[a.name]:
            if v not in p[a.table]:
                _fail(
                    f"override {a.name}",
                    f"{v!r} has no entry in presets.{preset}.{a.table}; pick another preset.",
                )
    rows = []
    for values in itertools.product(*(axes[a] for a in AXES)):
        cell = dict(zip(AXES, values))
        wf, sh, sc, tk, build, iv = (
            cell[a] for a in ("workflow", "sharing", "scale", "task", "build", "intervention")
        )
        if sh == "ip" and len(spec_of(wf).role_types) == 1:
            continue  # one role type (single), hence one policy: it only exists under sp
        if sh == "agent" and spec_of(wf).parallel_role is None:
            continue  # no parallel role (single, Eval-Opt): one agent per role type, which is ip
        if build and sc not in C.TOY_SCALES:
            _fail(
                f"{name}: presets.{preset}.axes.build",
                f"is {build} for scale {sc}, but only the toy models (scales {', '.join(C.TOY_SCALES)}) are "
                f"built from a seed (scale {sc}'s model is fixed); keep build [0] for it, or restrict the "
                "build axis to a toy-only preset.",
            )
        if any(_matches(w, cell) for w in p.get("exclude", [])):
            continue  # a slice of the grid (e.g. CI's paper_micro_ci)
        grpo, run = dict(p["grpo"]), dict(p.get("run", {}))
        for o in p.get("overrides", []):
            if _matches(o["when"], cell):
                grpo.update(o.get("grpo", {}))
                run = _merge(run, o.get("run", {}))
        rid = run_id(**cell, tag=p.get("tag", ""))  # a new axis must be given its part of the id there
        try:
            cfg = RunConfig(
                run_id=rid,
                **{a.field: cell[a.name] for a in AXES.values()},
                intervention_spec=dict(p["interventions"][iv]) if iv != "none" else {"kind": "none"},
                preset=preset,
                task=TaskSpec(**p["tasks"][tk]),
                model=model_of(p["models"][sc], build),
                grpo=GRPOParams(**grpo),
                **run,
            )
        except ConfigError as err:
            at, section = _written_in(doc, preset, str(err), tk)
            via = f", inherited by presets.{preset}" if at != preset else ""
            _fail(
                f"{name}: presets.{at} (run {rid}{via})",
                f"{err}. Fix it in presets.{at}.{section} or a matching entry of presets.{at}.overrides.",
            )
        cfg_json = json.dumps(cfg.to_dict(), sort_keys=True)
        rows.append({"run_id": rid, **cell, "preset": preset, "model": cfg.model, "config": cfg_json})
    if not rows:
        _fail(
            f"{name}: presets.{preset}.axes",
            "expands to no runs (single pairs with sp only, agent needs a workflow with a parallel role: voting, "
            "orch_workers); add sharing sp, or such a workflow.",
        )
    twice = sorted(r for r, n in collections.Counter(r["run_id"] for r in rows).items() if n > 1)
    if twice:  # run_id leaves an axis out: two cells would train into one folder
        _fail(
            f"{name}: presets.{preset}",
            f"expands to run {twice[0]!r} more than once; run_id must name every axis.",
        )
    return pd.DataFrame(rows).set_index("run_id")[SHEET_COLUMNS]


def output_dir(path_or_dict, preset: str | None = None, overrides: dict | None = None) -> str:
    """Where a preset's (or a slice's) tables, figures, report and their logs go, so that one never overwrites
    another's: `results` for the file's default preset in full (the paths the README documents),
    `results/presets/<preset>` for any other preset in full, and `.../slice-<axis>-<v1+v2>,<axis>-<v>` below
    either for a slice (--config axis restrictions that leave out some of the preset's values).
    Raises MatrixError like run_sheet."""
    doc, name, preset, p, axes = _selected(path_or_dict, preset, overrides)
    out = "results" if preset == doc["default_preset"] else f"results/presets/{preset}"
    sliced = [a for a in AXES if {str(v) for v in axes[a]} != {str(v) for v in p["axes"][a]}]
    if sliced:
        out += "/slice-" + ",".join(f"{a}-{'+'.join(str(v) for v in axes[a])}" for a in sliced)
    return out


def work_estimate(config_json: str) -> int:
    """Completion tokens a run generates at most (training rollouts and evaluations): the train rule's
    Snakemake priority, so the longest runs start first and the matrix does not end on one long job.

    Role calls per episode are upper bounds (WorkflowSpec.calls_per_episode: Eval-Opt 2 per round, Voting
    n_votes + 1, Orch-Workers n_workers + 2, single 1)."""
    cfg = RunConfig.from_dict(json.loads(config_json))
    g = cfg.grpo
    calls = spec_of(cfg.workflow).calls_per_episode(cfg, cfg.task_axis)
    evals = g.steps // g.eval_every + 1
    episodes = g.steps * g.problems_per_step * g.group_size + evals * (cfg.task.eval_size + cfg.task.val_size)
    return episodes * calls * g.max_completion_length
