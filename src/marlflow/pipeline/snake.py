"""What the Snakemake rules import: the run sheet as the rules see it, and every refusal before submission.

`rules/common.smk` calls `check_before_submit(config, workflow.resource_settings)` once, while Snakemake reads
the workflow: each check below either passes or prints one `error: ...` paragraph (what is wrong, where to
fix it, "Nothing was submitted") and exits 2, before any job is planned or submitted. The checks are plain
functions returning None or that message, so tests call them without Snakemake.

    sheet, out = check_before_submit(config, workflow.resource_settings)   # in rules/common.smk
    run_ranks(sheet, run_id)                                                # SLURM tasks of a train job
"""

from __future__ import annotations

import json
import sys

import pandas as pd

from marlflow.core.config import RunConfig
from marlflow.pipeline.matrix import (
    ALIASES,
    AXES,
    MatrixError,
    check_config_keys,
    check_run_ids,
    model_of,
    output_dir,
    run_sheet,
)

PLACEHOLDER = "CHANGE_ME"  # profiles/slurm ships `slurm_account: CHANGE_ME`


def load_sheet(config: dict) -> tuple[pd.DataFrame, str]:
    """(run sheet, output folder of its tables and report) for Snakemake's `config`; raises MatrixError.

    Axis restrictions from --config (workflows=[voting] tasks=[math]) narrow the preset; a typo in a key
    (wrkflows=, learning_rate=) is refused instead of ignored; run ids must be unique across every preset.
    Tables, figures and report go to results/ for the default preset in full, results/presets/<preset>[/slice-...]
    otherwise, so that none overwrites another's."""
    overrides = {k: config[k] for k in (*AXES, *ALIASES) if k in config}
    check_config_keys(config)
    sheet = run_sheet(config["matrix"], config.get("preset"), overrides)
    check_run_ids(config["matrix"])
    return sheet, output_dir(config["matrix"], config.get("preset"), overrides)


def placeholder_refusal(resource_settings) -> str | None:
    """A resource left at the profile's CHANGE_ME placeholder: sbatch would refuse every job one by one,
    after Snakemake had planned and started submitting. `resource_settings` is `workflow.resource_settings`."""
    found = [(None, n, r) for n, r in (resource_settings.default_resources or {}).items()]
    found += [(rule, n, r) for rule, m in resource_settings.overwrite_resources.items() for n, r in m.items()]
    for rule, name, res in found:
        if str(getattr(res, "raw", "")).strip("'\"") != PLACEHOLDER:
            continue
        where = f"set-resources: {rule}: {name}" if rule else f"default-resources: {name}"
        return (f"resource {name} is CHANGE_ME, the placeholder in profiles/slurm/config.yaml ({where}); set your "
                "SLURM account there, or in a copy of the profile (`sacctmgr show assoc user=$USER format=account` "
                f"lists yours). A cluster without accounting: drop {name} and add `slurm-no-account: true`. "
                "Nothing was submitted.")  # fmt: skip
    return None


def fit_refusal(sheet: pd.DataFrame, scale_resources: dict | None) -> str | None:
    """The planner's refusal of the first run predicted not to fit its GPUs, when the profile names their
    memory per scale (`scale_resources: {4b: {gpu_mem_gb: 80}}`); such a run would only fail hours later,
    out of memory on the node."""
    table = scale_resources or {}
    if not any("gpu_mem_gb" in (v or {}) for v in table.values()):
        return None
    from marlflow.pipeline.plan import refusal  # the planner imports torch-free but large tables: only here

    for _rid, row in sheet.iterrows():
        res = table.get(row["scale"]) or {}
        if res.get("gpu_mem_gb") is None:
            continue
        cfg = RunConfig.from_dict(json.loads(row["config"]))
        where = f"scale_resources.{row['scale']}.gpu_mem_gb in the profile's config"
        msg = refusal(cfg, float(res["gpu_mem_gb"]), int(res.get("gpu") or 1), where)
        if msg:
            return msg
    return None


def model_folders(sheet: pd.DataFrame) -> dict[str, dict]:
    """{folder under results/models: its scale, toy build and model}: one per (scale, build) of the sheet;
    a build b > 0 of the `build` axis is results/models/toy-b<b> (marlflow.pipeline.matrix.model_of)."""
    return {
        model_of(sc, b): {"scale": sc, "build": int(b), "model": m}
        for sc, b, m in zip(sheet["scale"], sheet["build"], sheet["model"], strict=True)
    }


def toy_seed_refusal(config: dict, sheet: pd.DataFrame) -> str | None:
    """`toy_build: "--seed 3"` together with builds > 0 would name the seed twice; argparse would keep the
    last and two folders could hold one model."""
    if "--seed" in str(config.get("toy_build", "")) and any(
        v["build"] for v in model_folders(sheet).values()
    ):
        return ("config toy_build sets --seed, but this preset also has toy builds > 0 (the build axis builds "
                "results/models/toy-b<b> with --seed b); drop --seed from toy_build, or restrict builds=[0].")  # fmt: skip
    return None


def run_ranks(sheet: pd.DataFrame, run_id: str) -> int:
    """A run's ranks from the run sheet: RunConfig.ranks, 1 when config.json has no such key (left out at 1)."""
    return int(json.loads(sheet.loc[run_id, "config"]).get("ranks", 1))


def ranks_gpu_refusal(sheet: pd.DataFrame, scale_resources: dict | None) -> str | None:
    """The first GPU run whose ranks differ from its scale's GPUs per run (`scale_resources.<scale>.gpu` of a
    SLURM profile): each rank needs its own GPU, and a mismatch would leave GPUs idle or put two ranks on one."""
    table = scale_resources or {}
    for rid, row in sheet.iterrows():
        gpu = (table.get(row["scale"]) or {}).get("gpu")
        cfg = json.loads(row["config"])
        ranks = int(cfg.get("ranks", 1))
        if cfg.get("device") == "cuda" and gpu is not None and int(gpu) != ranks:
            return (f"run {rid} has ranks {ranks} (matrix.yaml presets.{row['preset']}.run.ranks) but its scale "
                    f"{row['scale']} gets gpu {gpu} per run (scale_resources.{row['scale']}.gpu in the profile): "
                    "each rank needs one GPU, so set the two to the same number (docs/slurm.md, 'Several GPUs "
                    "per run'). Nothing was submitted.")  # fmt: skip
    return None


def _refuse(msg: str) -> None:
    # One paragraph, exit 2, no traceback: the same as `marlflow matrix` on a bad matrix.yaml.
    print(f"error: {msg}", file=sys.stderr)
    sys.stderr.flush()
    sys.exit(2)


def check_before_submit(config: dict, resource_settings) -> tuple[pd.DataFrame, str]:
    """Every refusal, in order, then (run sheet, output folder). Exits 2 with the first refusal's message."""
    if msg := placeholder_refusal(resource_settings):
        _refuse(msg)
    try:
        sheet, out = load_sheet(config)
    except MatrixError as err:
        _refuse(str(err))
    for check in (
        lambda: fit_refusal(sheet, config.get("scale_resources")),
        lambda: toy_seed_refusal(config, sheet),
        lambda: ranks_gpu_refusal(sheet, config.get("scale_resources")),
    ):
        if msg := check():
            _refuse(msg)
    return sheet, out
