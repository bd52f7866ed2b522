# The run sheet (one row per training run) and helpers shared by all rules.
import os
import re
import sys

from marlflow.pipeline.matrix import jobs_use_this_python, model_of, work_estimate
from marlflow.pipeline.snake import (
    changed_runs,
    check_before_submit,
    gpu_refusal,
    model_folders,
    run_ranks,
)

jobs_use_this_python()
# Nothing downloads at run time, with `make run` or plain `snakemake` alike (export HF_HUB_OFFLINE=0 to allow it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every refusal (a CHANGE_ME resource, a bad matrix.yaml or --config, a model path that no job could load, a CUDA
# preset whose jobs get no GPU, a run that does not fit its GPUs, two toy seeds, ranks that differ from GPUs per
# run) happens here, before any job: marlflow.pipeline.snake.
SHEET, OUT = check_before_submit(config, workflow.resource_settings)
RUN_IDS = list(SHEET.index)
# A CUDA preset whose train jobs would get no GPU (profiles/local on a machine without one): a dry run plans it with
# this warning, and a real run is refused by the Snakefile's onstart, before its first job.
GPU_REFUSAL = gpu_refusal(
    SHEET, config.get("scale_resources"), workflow.resource_settings
)
if GPU_REFUSAL and workflow.is_main_process:
    print(
        f"marlflow: warning: {GPU_REFUSAL} A dry run plans them; a real run stops before its first job.",
        file=sys.stderr,
    )
# What changed in each edited cell, in one line each (Snakemake's "Params have changed" prints both whole configs).
_CHANGED = changed_runs(SHEET) if workflow.is_main_process else []
if _CHANGED:
    print(
        f"marlflow: {len(_CHANGED)} run(s) changed in matrix.yaml (config.json rewritten, run retrained; "
        "its previous results stay until the new ones are written):",
        *(f"  {line}" for line in _CHANGED[:10]),
        *([f"  ... and {len(_CHANGED) - 10} more"] if len(_CHANGED) > 10 else []),
        sep="\n",
        file=sys.stderr,
    )
# One model folder per (scale, toy build): results/models/<scale>, or results/models/<scale>-b<b> for a
# build b > 0 of the `build` axis, which only the toy scales take (marlflow.core.config.TOY_SCALES: toy-b1,
# toy2-b1, ...; the run's model is then <models.<scale>>-b<b>; marlflow.pipeline.matrix.model_of).
MODEL_FOLDERS = model_folders(SHEET)


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
