"""The HTML report: findings first, one page per run, figures embedded, provenance last.

`build` writes results/report.html and results/report/<run>.html from the aggregate tables and the runs'
metrics (the `marlflow report` command's library).

May import: store, core, tasks, models, training (environment: which machine ran a run), analysis.
"""
