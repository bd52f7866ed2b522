"""The HTML report: findings first, one page per run, figures embedded, provenance last.

`build` reads the aggregate tables and the runs' metrics and writes results/report.html, its figures and
results/report/<run>.html (the `marlflow report` command's library); `findings` (the box the overview opens
with), `provenance` (commit, packages, CPU, toy model), `pages` (one page per run) and `html` (escaping,
formats, tables, the page shell) are its parts.

May import: store, core, tasks, models, training (environment: which machine ran a run), analysis.
"""
