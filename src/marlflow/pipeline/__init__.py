"""From matrix.yaml to jobs: the run sheet, the planner, and what the Snakemake rules import.

`matrix` (validate matrix.yaml, expand a preset into one RunConfig per run), `plan` (GPU memory, step time
and GPU-hours per run; refusals before submission), `snake` (the few functions `rules/*.smk` call).

May import: store, core, tasks, workflows, models, training (for the launcher's rank settings).
"""
