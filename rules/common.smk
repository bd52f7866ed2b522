# The run sheet (one row per training run) and helpers shared by all rules.
import os
import sys
import re

from marlflow.pipeline.matrix import (
    ALIASES,
    AXES,
    MatrixError,
    check_config_keys,
    check_run_ids,
    jobs_use_this_python,
    model_of,
    output_dir,
    run_sheet,
    work_estimate,
)

jobs_use_this_python()


def _load_sheet():
    # Axis restrictions from --config (e.g. workflows=[voting] tasks=[math]) narrow the preset.
    overrides = {k: config[k] for k in (*AXES, *ALIASES) if k in config}
    try:
        # A typo (wrkflows=, learning_rate=) would otherwise be ignored in silence.
        check_config_keys(config)
        sheet = run_sheet(config["matrix"], config.get("preset"), overrides)
        check_run_ids(config["matrix"])  # one run id, one run, across every preset
        # Tables, figures and report of this preset or slice: results/ for the default preset in full,
        # results/presets/<preset>[/slice-...] otherwise, so that none overwrites another's.
        return sheet, output_dir(config["matrix"], config.get("preset"), overrides)
    except MatrixError as err:
        # Same one-paragraph message and exit code as `python -m marlflow.pipeline.matrix`, no traceback.
        print(f"error: {err}", file=sys.stderr)
        sys.stderr.flush()
        sys.exit(2)


def _refuse_placeholder_resources():
    # profiles/slurm ships `slurm_account: CHANGE_ME`: sbatch would refuse every job, one by one, after
    # Snakemake had planned and started submitting. Refused here, before any job, with where to set it.
    rs = workflow.resource_settings
    found = [(None, n, r) for n, r in (rs.default_resources or {}).items()]
    found += [
        (rname, n, r)
        for rname, m in rs.overwrite_resources.items()
        for n, r in m.items()
    ]
    for rname, name, res in found:
        if str(getattr(res, "raw", "")).strip("'\"") != "CHANGE_ME":
            continue
        where = (
            f"set-resources: {rname}: {name}" if rname else f"default-resources: {name}"
        )
        print(
            f"error: resource {name} is CHANGE_ME, the placeholder in profiles/slurm/config.yaml ({where}); "
            f"set your SLURM account there, or in a copy of the profile (`sacctmgr show assoc user=$USER "
            f"format=account` lists yours). A cluster without accounting: drop {name} and add "
            "`slurm-no-account: true`. Nothing was submitted.",
            file=sys.stderr,
        )
        sys.stderr.flush()
        sys.exit(2)


_refuse_placeholder_resources()
SHEET, OUT = _load_sheet()


def _refuse_runs_that_do_not_fit():
    # A profile that names its GPUs' memory per scale (scale_resources: {4b: {gpu_mem_gb: 80}}) gets every run
    # checked by the planner before anything is submitted: a run predicted not to fit would only fail hours
    # later, out of memory on the node. Same one-paragraph message style and exit code as a matrix error.
    table = config.get("scale_resources") or {}
    if not any("gpu_mem_gb" in (v or {}) for v in table.values()):
        return
    import json

    from marlflow.core.config import RunConfig
    from marlflow.pipeline.plan import refusal

    for rid, row in SHEET.iterrows():
        res = table.get(row["scale"]) or {}
        if res.get("gpu_mem_gb") is None:
            continue
        cfg = RunConfig.from_dict(json.loads(row["config"]))
        where = f"scale_resources.{row['scale']}.gpu_mem_gb in the profile's config"
        msg = refusal(cfg, float(res["gpu_mem_gb"]), int(res.get("gpu") or 1), where)
        if msg:
            print(f"error: {msg}", file=sys.stderr)
            sys.stderr.flush()
            sys.exit(2)


_refuse_runs_that_do_not_fit()
RUN_IDS = list(SHEET.index)
# One model folder per (scale, toy build): results/models/<scale>, or results/models/toy-b<b> for a build b > 0
# of the `build` axis (the run's model is then <models.toy>-b<b>; marlflow.pipeline.matrix.model_of).
MODEL_FOLDERS = {
    model_of(sc, b): {"scale": sc, "build": int(b), "model": m}
    for sc, b, m in zip(SHEET["scale"], SHEET["build"], SHEET["model"])
}


def _refuse_two_toy_seeds():
    # `toy_build: "--seed 3"` together with builds > 0 would name the seed twice; argparse would keep the last
    # and two folders could hold one model.
    if "--seed" in str(config.get("toy_build", "")) and any(
        v["build"] for v in MODEL_FOLDERS.values()
    ):
        print(
            "error: config toy_build sets --seed, but this preset also has toy builds > 0 (the build axis builds "
            "results/models/toy-b<b> with --seed b); drop --seed from toy_build, or restrict builds=[0].",
            file=sys.stderr,
        )
        sys.stderr.flush()
        sys.exit(2)


_refuse_two_toy_seeds()


def model_folder(wildcards):
    row = SHEET.loc[wildcards.run_id]
    return f"results/models/{model_of(row['scale'], row['build'])}"


def toy_build_options(folder):
    build = MODEL_FOLDERS[folder]["build"]
    return " ".join(
        [str(config.get("toy_build", "")), f"--seed {build}" if build else ""]
    ).strip()


# Longest first: a train job's priority is the rank of its estimated work (marlflow.pipeline.matrix.work_estimate),
# so the matrix does not end with one long run on an otherwise idle machine.
_WORK = {r: work_estimate(c) for r, c in SHEET["config"].items()}
PRIORITY = {
    r: rank for rank, r in enumerate(sorted(RUN_IDS, key=lambda r: (_WORK[r], r)), 1)
}


wildcard_constraints:
    run_id="|".join(re.escape(r) for r in RUN_IDS),
    folder="|".join(re.escape(f) for f in MODEL_FOLDERS),


def run_scale(wildcards):
    return SHEET.loc[wildcards.run_id, "scale"]


def scale_resource(name, default):
    """A resource of the train rule that depends on the run's scale.

    The per-scale table is compute configuration, so it lives in a profile's config
    (`scale_resources: {0.6b: {gpu: 1, mem_mb: 64000, ...}}`); absent entries fall back to
    `default`, i.e. CPU only. `default` may be a callable of (wildcards, threads).
    """

    def get(wildcards, threads):
        table = config.get("scale_resources") or {}
        value = (table.get(run_scale(wildcards)) or {}).get(name)
        if value is None:
            return default(wildcards, threads) if callable(default) else default
        # --config values arrive as strings; resources must be numbers where they look like numbers.
        return int(value) if str(value).isdigit() else value

    return get
