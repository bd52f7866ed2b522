"""matrix.yaml -> run sheet: one row per training run, validated up front.

The experiment design lives in `matrix.yaml` as presets (toy, smol, paper, ...). A preset lists the axes
(workflow x sharing x scale x task x seed x intervention), maps each task and scale to a dataset and a model,
and sets GRPO and run-level settings, with optional per-cell `overrides`. Expanding a preset builds one
`RunConfig` per cell, so every invalid value fails here, before Snakemake schedules anything, with one
paragraph that names the key path and the fix.

    python -m marlflow.matrix matrix.yaml                  # validate, print the default preset's run sheet
    python -m marlflow.matrix matrix.yaml --preset paper --json

    from marlflow.matrix import run_sheet
    sheet = run_sheet("matrix.yaml", preset="toy", overrides={"workflow": ["voting"]})
    RunConfig.from_dict(json.loads(sheet.loc["voting-ip-toy-math-s0", "config"]))
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import itertools
import json
import sys
from importlib import resources
from pathlib import Path

import jsonschema
import pandas as pd
import yaml

from marlflow import config as C
from marlflow.config import ConfigError, GRPOParams, RunConfig, TaskSpec

AXES = ("workflow", "sharing", "scale", "task", "seed", "intervention")
# Plural spellings accepted as overrides, e.g. `snakemake --config workflows=[voting] tasks=[math]`.
ALIASES = {
    "workflows": "workflow",
    "scales": "scale",
    "tasks": "task",
    "seeds": "seed",
    "interventions": "intervention",
}
SHEET_COLUMNS = [*AXES, "preset", "model", "config"]
# RunConfig fields that come from the axes and the task/model maps, not from a preset's `run:` section.
NOT_RUN_LEVEL = {
    "run_id",
    "workflow",
    "sharing",
    "scale",
    "task_axis",
    "seed",
    "task",
    "model",
    "intervention",
}
NOT_RUN_LEVEL |= {"preset", "grpo"}
JSON_TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "dict": "object"}


class MatrixError(ValueError):
    """An invalid matrix file, preset or override; the message is one paragraph naming the key path."""


def _fields_schema(cls, skip=()) -> dict:
    # Field types are strings ("int", "float") because config.py uses `from __future__ import annotations`.
    return {f.name: {"type": JSON_TYPES[str(f.type)]} for f in dataclasses.fields(cls) if f.name not in skip}


def schema() -> dict:
    """The JSON schema of matrix.yaml, with enums and field lists taken from marlflow.config."""
    s = json.loads(resources.files("marlflow").joinpath("matrix_schema.json").read_text())
    d = s["$defs"]
    for name, values in [
        ("workflow", C.WORKFLOWS),
        ("sharing", C.SHARINGS),
        ("scale", C.SCALES),
        ("task_axis", C.TASK_AXIS),
        ("intervention", C.INTERVENTIONS),
    ]:
        d[name]["enum"] = list(values)
    d["task"]["properties"] = _fields_schema(TaskSpec)
    d["grpo"]["properties"] = _fields_schema(GRPOParams)
    d["run"]["properties"] = _fields_schema(RunConfig, skip=NOT_RUN_LEVEL)
    d["preset"]["properties"]["tasks"]["properties"] = {t: {"$ref": "#/$defs/task"} for t in C.TASK_AXIS}
    models = d["preset"]["properties"]["models"]
    models["properties"] = {s: {"type": "string", "minLength": 1} for s in C.SCALES}
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
        extra = [k for k in v if k not in allowed]
        if sch.get("patternProperties"):
            return f"{path} has an invalid name {extra[0]!r}: use lower-case letters, digits and '_'."
        where = _keypath([*err.absolute_path, extra[0]])
        return (
            f"{where} is not a known key.{_did_you_mean(extra[0], allowed)} "
            f"Allowed keys under {path}: {', '.join(allowed)}."
        )
    if err.validator == "enum":
        return (
            f"{path} is {v!r}, which is not allowed.{_did_you_mean(v, err.validator_value)} "
            f"Allowed values: {', '.join(map(str, err.validator_value))}."
        )
    if err.validator == "type":
        hint = ""
        if err.validator_value == "number" and isinstance(v, str):
            hint = " (YAML reads 2e-3 as text; write 2.0e-3)"
        want = (
            err.validator_value if isinstance(err.validator_value, str) else " or ".join(err.validator_value)
        )
        return f"{path} is {v!r} of type {type(v).__name__}, but it must be {want}{hint}."
    if err.validator == "minItems":
        return f"{path} is empty; list at least one value, or delete the key to inherit it."
    if err.validator == "uniqueItems":
        return f"{path} lists a value more than once: {v!r}."
    if err.validator == "required":
        return f"{path}: {err.message}."
    if err.validator in ("minimum", "minLength", "minProperties"):
        return f"{path} is {v!r}, which is too small ({err.validator}: {err.validator_value})."
    return f"{path}: {err.message}."


def _fail(where: str, msg: str):
    raise MatrixError(" ".join(f"{where}: {msg}".split()))


def load_matrix(path_or_dict) -> dict:
    """Read matrix.yaml (or take an already parsed dict) and validate it against the schema."""
    if isinstance(path_or_dict, dict):
        doc, name = copy.deepcopy(path_or_dict), "matrix"
    else:
        name = str(path_or_dict)
        try:
            doc = yaml.safe_load(Path(path_or_dict).read_text())
        except FileNotFoundError:
            _fail(name, "file not found; pass the path of the matrix file (default matrix.yaml).")
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            _fail(name, f"not valid YAML{where}: {getattr(err, 'problem', err)}.")
    if not isinstance(doc, dict):
        _fail(
            name,
            f"the file must be a mapping with keys default_preset and presets, not {type(doc).__name__}.",
        )
    # A scalar where a list is expected (`seed: 0`, `when: {task: math}`) means a one-element list.
    for preset in (doc.get("presets") or {}).values():
        if isinstance(preset, dict):
            sections = [preset.get("axes")] + [
                o.get("when") for o in preset.get("overrides") or [] if isinstance(o, dict)
            ]
            for sec in sections:
                for k, val in (sec or {}).items() if isinstance(sec, dict) else ():
                    if k in AXES and isinstance(val, str | int) and not isinstance(val, bool):
                        sec[k] = [val]
    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema()).iter_errors(doc))
    if err is not None:
        _fail(name, _describe(err))
    if doc["default_preset"] not in doc["presets"]:
        _fail(f"{name}: default_preset", _unknown_preset(doc["default_preset"], doc))
    for p in doc["presets"]:
        resolve_preset(doc, p, name)
    return doc


def _unknown_preset(preset, doc) -> str:
    names = list(doc["presets"])
    return f"{preset!r} is not a defined preset.{_did_you_mean(preset, names)} Defined presets: {', '.join(names)}."


def _merge(base: dict, top: dict) -> dict:
    """Deep merge: mappings merge key by key, anything else (lists included) is replaced."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_preset(doc: dict, preset: str, name: str = "matrix") -> dict:
    """The preset with its `extends` chain merged in, checked for completeness."""
    chain, p = [], preset
    while p is not None:
        if p in chain:
            _fail(f"{name}: presets.{preset}.extends", f"extends forms a cycle: {' -> '.join([*chain, p])}.")
        if p not in doc["presets"]:
            _fail(f"{name}: presets.{chain[-1]}.extends", _unknown_preset(p, doc))
        chain.append(p)
        p = doc["presets"][p].get("extends")
    out = {}
    for p in reversed(chain):
        out = _merge(out, {k: v for k, v in doc["presets"][p].items() if k != "extends"})
    for key in ("axes", "tasks", "models", "grpo"):
        if key not in out:
            _fail(
                f"{name}: presets.{preset}.{key}", "is missing; every preset needs axes, tasks, models, grpo."
            )
    for axis in ("workflow", "sharing", "scale", "task"):
        if axis not in out["axes"]:
            _fail(f"{name}: presets.{preset}.axes.{axis}", "is missing; list the values to run.")
    out["axes"].setdefault("seed", [0])
    out["axes"].setdefault("intervention", ["none"])
    for axis, table in (("task", "tasks"), ("scale", "models")):
        for v in out["axes"][axis]:
            if v not in out[table]:
                _fail(
                    f"{name}: presets.{preset}.{table}",
                    f"has no entry for {axis} {v!r} (listed in presets.{preset}.axes.{axis}); "
                    f"add `{v}: ...` under presets.{preset}.{table} or drop {v!r} from the axis.",
                )
    return out


def _apply_overrides(axes: dict, overrides: dict) -> dict:
    """Restrict or replace axes from the command line, e.g. {"workflows": ["voting"], "seed": "1"}."""
    axes = dict(axes)
    allowed = {
        "workflow": C.WORKFLOWS,
        "sharing": C.SHARINGS,
        "scale": C.SCALES,
        "task": C.TASK_AXIS,
        "intervention": C.INTERVENTIONS,
    }
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
        if axis == "seed":
            try:
                vals = [int(v) for v in vals]
            except (TypeError, ValueError):
                _fail(f"override {key}", f"is {val!r}; seeds must be integers, e.g. seeds=[0,1,2].")
        else:
            vals = [str(v) for v in vals]
            for v in vals:
                if v not in allowed[axis]:
                    _fail(
                        f"override {key}",
                        f"{v!r} is not a known {axis}.{_did_you_mean(v, allowed[axis])} "
                        f"Allowed values: {', '.join(allowed[axis])}.",
                    )
        axes[axis] = list(dict.fromkeys(vals))
    return axes


def _matches(when: dict, cell: dict) -> bool:
    return all(cell[k] in v for k, v in when.items())


def run_id(workflow: str, sharing: str, scale: str, task: str, seed: int, intervention: str = "none") -> str:
    rid = f"{workflow}-{sharing}-{scale}-{task}-s{seed}"
    return (rid if intervention == "none" else f"{rid}-{intervention}").lower()


def run_sheet(path_or_dict, preset: str | None = None, overrides: dict | None = None) -> pd.DataFrame:
    """Expand one preset into a DataFrame indexed by run_id (columns: SHEET_COLUMNS).

    `config` holds the JSON of `RunConfig.to_dict()`; building the RunConfig here means every invalid
    value is caught at expansion time. Raises MatrixError.
    """
    doc = load_matrix(path_or_dict)
    name = "matrix" if isinstance(path_or_dict, dict) else str(path_or_dict)
    preset = preset or doc["default_preset"]
    if preset not in doc["presets"]:
        _fail(f"{name}: preset", _unknown_preset(preset, doc))
    p = resolve_preset(doc, preset, name)
    axes = _apply_overrides(p["axes"], overrides)
    for axis in ("scale", "task"):
        table = {"scale": "models", "task": "tasks"}[axis]
        for v in axes[axis]:
            if v not in p[table]:
                _fail(
                    f"override {axis}",
                    f"{v!r} has no entry in presets.{preset}.{table}; pick another preset.",
                )
    rows = []
    for wf, sh, sc, tk, seed, iv in itertools.product(*(axes[a] for a in AXES)):
        if wf == "single" and sh == "ip":
            continue  # single has one role, hence one policy: it only exists under sp
        cell = dict(workflow=wf, sharing=sh, scale=sc, task=tk, seed=seed, intervention=iv)
        grpo, run = dict(p["grpo"]), dict(p.get("run", {}))
        for o in p.get("overrides", []):
            if _matches(o["when"], cell):
                grpo.update(o.get("grpo", {}))
                run = _merge(run, o.get("run", {}))
        rid = run_id(wf, sh, sc, tk, seed, iv)
        try:
            cfg = RunConfig(
                run_id=rid,
                workflow=wf,
                sharing=sh,
                scale=sc,
                task_axis=tk,
                seed=seed,
                intervention=iv,
                preset=preset,
                task=TaskSpec(**p["tasks"][tk]),
                model=p["models"][sc],
                grpo=GRPOParams(**grpo),
                **run,
            )
        except ConfigError as err:
            _fail(
                f"{name}: presets.{preset} (run {rid})",
                f"{err}. Fix it in presets.{preset}.grpo/run/tasks or a matching entry of presets.{preset}.overrides.",
            )
        cfg_json = json.dumps(cfg.to_dict(), sort_keys=True)
        rows.append({"run_id": rid, **cell, "preset": preset, "model": cfg.model, "config": cfg_json})
    if not rows:
        _fail(
            f"{name}: presets.{preset}.axes",
            "expands to no runs (single pairs with sp only); add sharing sp.",
        )
    return pd.DataFrame(rows).set_index("run_id")[SHEET_COLUMNS]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m marlflow.matrix", description="Validate matrix.yaml and print a preset's run sheet."
    )
    ap.add_argument("file", nargs="?", default="matrix.yaml", help="matrix file (default: matrix.yaml)")
    ap.add_argument("--preset", help="preset to expand (default: the file's default_preset)")
    ap.add_argument(
        "--only", nargs="*", default=[], metavar="AXIS=V1,V2", help="restrict axes, e.g. workflow=voting"
    )
    ap.add_argument("--json", action="store_true", help="print the run sheet as JSON records")
    args = ap.parse_args(argv)
    try:
        overrides = {}
        for item in args.only:
            key, _, vals = item.partition("=")
            overrides[key] = vals.split(",") if vals else []
        sheet = run_sheet(args.file, args.preset, overrides)
    except MatrixError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        recs = [{"run_id": rid, **row, "config": json.loads(row["config"])} for rid, row in sheet.iterrows()]
        print(json.dumps(recs, indent=2))
    else:
        with pd.option_context("display.max_rows", None, "display.width", 200):
            print(sheet[list(AXES)].to_string())
        print(f"{len(sheet)} runs (preset {sheet['preset'].iloc[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
