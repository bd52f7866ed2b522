"""marlflow: matrix.yaml -> one GRPO training job per run -> tables, figures, report.

    snakemake --profile profiles/local                        # the default preset, toy2, on CPU (make run)
    snakemake --profile profiles/local --config preset=smol workflows=[voting] tasks=[math]
    snakemake --profile profiles/slurm                        # paper preset on a SLURM GPU cluster

Config keys (--config): matrix (default matrix.yaml), preset (default: the file's default_preset), axis
restrictions workflow(s)/sharing/scale(s)/task(s)/seed(s)/build(s)/intervention(s), and report_to (the trackers
of the runs that train now, e.g. report_to=[tensorboard]; config.json and finished runs stay). Compute settings
(cores, GPUs, partitions) live in profiles/; the experiment design and its run settings (device, threads,
ranks) in matrix.yaml; this file only wires rules together (marlflow.pipeline.snake holds what they call).
"""

import sys
from pathlib import Path

# The package lives in src/; this makes the run sheet loadable without `pip install -e .`
# (the jobs' `python -m marlflow.<verb>` need the package installed: `make run` does that).
sys.path.insert(0, str(Path(workflow.basedir) / "src"))

config.setdefault("matrix", "matrix.yaml")

from marlflow.pipeline.snake import clear_stale_backups, refuse


include: "rules/signals.smk"
include: "rules/common.smk"
include: "rules/models.smk"
include: "rules/train.smk"
include: "rules/aggregate.smk"
include: "rules/report.smk"


# Every run's finished outputs are inputs of the default target too, not only of the tables: Snakemake checks
# a target's inputs, but skips a missing intermediate whose downstream files are up to date, so a run folder deleted,
# moved away or left unfinished by a killed retrain would otherwise be missed while the tables still list it. This
# way `make run` retrains such a run (resuming from its checkpoints where it can) and rebuilds the tables and report.
rule all:
    default_target: True
    input:
        rules.aggregate.output,
        rules.report.output,
        expand(rules.train.output, run_id=RUN_IDS),


# A real run (not a dry run), holding the workflow's lock, before any job starts: a CUDA preset whose jobs would get
# no GPU stops here (rules/common.smk); what a killed Snakemake left of the train rule's update() copies would stop
# the next retrain of that run (rules/train.smk; marlflow.pipeline.snake.clear_stale_backups).
onstart:
    if GPU_REFUSAL:
        refuse(f"{GPU_REFUSAL} Nothing was run.")
    clear_stale_backups(expand(rules.train.output, run_id=RUN_IDS))
