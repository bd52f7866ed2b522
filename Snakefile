"""marlflow: matrix.yaml -> one GRPO training job per run -> tables, figures, report.

    snakemake --profile profiles/local                        # toy preset on CPU (make run)
    snakemake --profile profiles/local --config preset=smol workflows=[voting] tasks=[math]
    snakemake --profile profiles/slurm                        # paper preset on a SLURM GPU cluster

Config keys (--config): matrix (default matrix.yaml), preset (default: the file's default_preset), and
axis restrictions workflow(s)/sharing/scale(s)/task(s)/seed(s)/build(s)/intervention(s). Compute settings
(cores, GPUs, partitions) live in profiles/; the experiment design and its run settings (device, threads,
ranks) in matrix.yaml; this file only wires rules together (marlflow.pipeline.snake holds what they call).
"""

import sys
from pathlib import Path

# The package lives in src/; this makes the run sheet loadable without `pip install -e .`
# (the jobs' `python -m marlflow.<verb>` need the package installed: `make run` does that).
sys.path.insert(0, str(Path(workflow.basedir) / "src"))

config.setdefault("matrix", "matrix.yaml")


include: "rules/signals.smk"
include: "rules/common.smk"
include: "rules/models.smk"
include: "rules/train.smk"
include: "rules/aggregate.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        rules.aggregate.output,
        rules.report.output,
