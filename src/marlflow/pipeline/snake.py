"""What the Snakemake rules import: the run sheet as the rules see it, and every refusal before submission.

`rules/common.smk` calls `check_before_submit(config, workflow.resource_settings)` once, while Snakemake reads
the workflow: each check below either passes or prints one `error: ...` paragraph (what is wrong, where to
fix it, "Nothing was submitted") and exits 2, before any job is planned or submitted. The checks are plain
functions returning None or that message, so tests call them without Snakemake. Among them: every model a
run names is a folder the `models` rule prepares, an existing model folder or a hub id (`model_refusal`), and a
preset whose runs need a CUDA GPU gets one (`gpu_refusal`: the profile's `gpu` resource, or a GPU here; a dry
run only warns, and the Snakefile's onstart refuses a real run before its first job).

    sheet, out = check_before_submit(config, workflow.resource_settings)   # in rules/common.smk
    run_ranks(sheet, run_id)                                                # SLURM tasks of a train job
    changed_runs(sheet)            # "<run id>: grpo.steps: 40 -> 60" for each run whose matrix cell changed
    clear_stale_backups(paths)     # the Snakefile's onstart: backups a killed Snakemake left (update() outputs)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pandas as pd

from marlflow.core.config import (
    REPORT_TO_ENV,
    TOY_SCALES,
    ConfigError,
    RunConfig,
    config_differences,
    trackers_from_env,
)
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
    a build b > 0 of the `build` axis (a toy scale, TOY_SCALES) is results/models/<scale>-b<b>
    (marlflow.pipeline.matrix.model_of): results/models/toy-b1, results/models/toy2-b1, ..."""
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
                "results/models/<scale>-b<b> with --seed b); drop --seed from toy_build, or restrict "
                "builds=[0].")  # fmt: skip
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


# Scales whose model the `models` rule builds into results/models/<scale>[-b<build>] (marlflow.models.loading.prepare);
# a run of one of them must train from that folder, or from a model folder that exists already.
BUILT_SCALES = (*TOY_SCALES, "smol")
# What a hub model id looks like (owner/name), as marlflow.models.loading.HUB_ID; repeated here so that reading the
# workflow does not import torch.
_HUB_ID = r"^[A-Za-z0-9][\w.-]*/[\w.-]+$"


def model_folder_problem(folder: Path) -> str | None:
    """What a local model folder lacks to be loaded (config.json, weights, tokenizer), None when it has all."""
    if not folder.is_dir():
        return "does not exist" if not folder.exists() else "is a file, not a model folder"
    if not (folder / "config.json").is_file():
        return "has no config.json"
    weights = [
        p.name
        for p in folder.iterdir()
        if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")
    ]
    if not weights:
        return "has no weights (*.safetensors or *.bin)"
    if not any(
        (folder / t).is_file() for t in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return "has no tokenizer (tokenizer.json or tokenizer_config.json)"
    return None


def model_refusal(sheet: pd.DataFrame, matrix: str = "matrix.yaml") -> str | None:
    """The first model of the sheet that no job could train from: a toy (TOY_SCALES) or smol model that is
    neither the folder the `models` rule prepares (results/models/<scale>[-b<build>]) nor an existing model
    folder, a local path that does not exist or lacks config.json / weights / tokenizer, or a value that is
    neither a path nor a hub id. Before: a typo passed, the `models` rule prepared the scale's folder anyway,
    and each train job failed late, after Snakemake had deleted that run's previous outputs."""
    import re

    from marlflow.pipeline.matrix import model_of

    for (scale, build, model), rows in sheet.groupby(["scale", "build", "model"], sort=False):
        where = f"{matrix} presets.{rows['preset'].iloc[0]}.models.{scale}"
        prepared = f"results/models/{model_of(scale, int(build))}"
        if scale in BUILT_SCALES and Path(model).as_posix() == prepared:
            continue  # the models rule builds it
        path = Path(str(model)).expanduser()
        looks_local = str(model).startswith(("/", ".", "~", "results/")) or str(model).count("/") != 1
        if (
            scale not in BUILT_SCALES
            and not looks_local
            and re.match(_HUB_ID, str(model))
            and not path.exists()
        ):
            continue  # a hub id: the models rule checks it (local cache or the hub) before any GPU job
        problem = model_folder_problem(path)
        if problem is None:
            continue
        hint = (f"the `models` rule prepares scale {scale}'s model in {prepared}, so write that"
                if scale in BUILT_SCALES else f"give scale {scale} a hub id such as Qwen/Qwen3-0.6B or a local model "
                "folder with config.json, weights and a tokenizer")  # fmt: skip
        return (f"{where}: the model folder {str(model)!r} {problem} (relative to {Path.cwd()}), so run "
                f"{rows.index[0]}{f' and {len(rows) - 1} more' if len(rows) > 1 else ''} could not start; "
                f"{hint}. Nothing was run and no run's results were touched.")  # fmt: skip
    return None


def _gpu_requested(scale: str, scale_resources: dict | None, resource_settings) -> bool:
    """Whether a train job of `scale` asks for a GPU: scale_resources.<scale>.gpu, or set-resources train:gpu."""
    value = ((scale_resources or {}).get(scale) or {}).get("gpu")
    if value is None and resource_settings is not None:
        res = (resource_settings.overwrite_resources or {}).get("train", {}).get("gpu")
        value = getattr(res, "raw", res)
    try:
        return int(str(value).strip("'\"")) >= 1
    except (TypeError, ValueError):
        return False


def local_cuda() -> bool:
    """Whether this machine has a CUDA GPU that torch sees (imports torch: called only for a cuda preset)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def gpu_refusal(sheet: pd.DataFrame, scale_resources: dict | None, resource_settings=None,
                cuda_here=local_cuda) -> str | None:  # fmt: skip
    """The first run with device cuda whose train job would get no GPU: its scale has no `gpu` in the profile's
    scale_resources (nor set-resources train:gpu), so the job runs on this machine's CPUs or a CPU node, and
    this machine has no CUDA GPU either (`cuda_here()`). Before: `--config preset=paper` under profiles/local
    scheduled 42 CUDA runs on a CPU and failed with a traceback in the `models` rule."""
    cuda = [(rid, row) for rid, row in sheet.iterrows() if json.loads(row["config"]).get("device") == "cuda"]
    no_gpu = [
        (rid, row)
        for rid, row in cuda
        if not _gpu_requested(row["scale"], scale_resources, resource_settings)
    ]
    if not no_gpu or cuda_here():
        return None
    rid, row = no_gpu[0]
    preset = row["preset"]
    return (f"preset {preset} trains on device cuda (matrix.yaml presets.{preset}.run.device), but its train jobs "
            f"would get no GPU: the profile gives scale {row['scale']} none (scale_resources.{row['scale']}.gpu) "
            f"and this machine has no CUDA GPU that torch sees; {len(no_gpu)} run(s) such as {rid} would fail at "
            "their start. Run it where the jobs get GPUs (snakemake --profile slurm --default-resources "
            "slurm_account=ACCT slurm_partition=PART), or pick a CPU preset (toy, smol, paper_micro).")  # fmt: skip


def report_to_refusal(config: dict) -> str | None:
    """`--config report_to=[tensorboard]`: the trackers of the runs that train now, handed to their jobs through
    the environment (marlflow.core.config.REPORT_TO_ENV) so that config.json, the fingerprint and Snakemake's
    params stay as they are (no finished run is retrained). Sets the variable; returns a refusal for a name that
    is not a tracker."""
    if "report_to" not in config:
        return None
    value = config["report_to"]
    names = value if isinstance(value, list | tuple) else [value]
    text = ",".join(str(n) for n in names if n is not None) or "none"
    try:
        trackers_from_env({REPORT_TO_ENV: text})
    except ConfigError as err:
        return (
            f"--config report_to: {str(err).replace(REPORT_TO_ENV + ' ', '')} (e.g. report_to=[tensorboard])."
        )
    os.environ[REPORT_TO_ENV] = text
    return None


def changed_runs(sheet: pd.DataFrame, root: str | Path = ".", limit: int = 3) -> list[str]:
    """One line per run whose results/runs/<id>/config.json differs from its matrix cell now, saying what changed
    ("grpo.steps: 40 -> 60"): those config.json files are rewritten and the runs retrained (Snakemake itself
    prints both whole configs)."""
    out = []
    for rid, cfg_json in sheet["config"].items():
        path = Path(root) / "results" / "runs" / rid / "config.json"
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a new run, or a config.json Snakemake rewrites anyway
        new = json.loads(cfg_json)
        if old != new:
            diff = config_differences(old, new, limit=limit, provenance=True) or ["formatting only"]
            out.append(f"{rid}: " + "; ".join(diff))
    return out


def clear_stale_backups(paths, backups: str | Path = ".snakemake/backups") -> list[str]:
    """Remove (or put back) what a killed Snakemake left in its backup folder for `paths` (the train rule's
    update() outputs of every run); returns the paths it acted on.

    Snakemake copies an update() output there before the job starts and restores it if the job fails; a
    Snakemake killed in between leaves the copy, and the next start of that job fails with FileExistsError on
    a folder's copy (final/). Called from the Snakefile's onstart, i.e. holding the workflow's lock with no job
    started, so no job of this workflow is using a copy. The trainer replaces its outputs only at its end,
    atomically, so the file in place is the one to keep; a copy whose output is missing is put back."""
    done = []
    for p in map(Path, paths):
        copy = Path(backups) / (p.relative_to(p.anchor) if p.is_absolute() else p)
        if not copy.exists() and not copy.is_symlink():
            continue
        if p.exists():
            shutil.rmtree(copy) if copy.is_dir() else copy.unlink()
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(copy), str(p))
        done.append(str(p))
    return done


def refuse(msg: str) -> None:
    """Print `error: msg` and exit 2: a refusal made outside check_before_submit (the Snakefile's onstart)."""
    _refuse(msg)


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
        lambda: report_to_refusal(config),
        lambda: model_refusal(sheet, str(config.get("matrix", "matrix.yaml"))),
        lambda: fit_refusal(sheet, config.get("scale_resources")),
        lambda: toy_seed_refusal(config, sheet),
        lambda: ranks_gpu_refusal(sheet, config.get("scale_resources")),
    ):
        if msg := check():
            _refuse(msg)
    return sheet, out
