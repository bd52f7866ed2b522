# Tables + per-run metrics -> figures, the overview page and one page per run.
# Every file marlflow.report.build writes is declared, generated from its own output contract (`outputs()`).
import json

from marlflow.report.build import outputs as report_outputs
from marlflow.tasks.solution_metrics import names_of as solution_metric_names

# Under OUT (rules/common.smk): results/ for the default preset in full, else the preset's or slice's folder.
REPORT_FIGURES = f"{OUT}/figures"
REPORT_HTML = f"{OUT}/report.html"
REPORT_PAGES = f"{OUT}/report"
REPORT_OUTPUTS = [
    str(p)
    for p in report_outputs(
        REPORT_FIGURES,
        REPORT_HTML,
        REPORT_PAGES,
        RUN_IDS,
        interventions=bool((SHEET["intervention"] != "none").any()),
        # the runs' registered tasks, as config.json will name them: the report reads the same names
        solution_metrics=bool(
            solution_metric_names(
                json.loads(c)["task"]["name"] for c in SHEET["config"]
            )
        ),
    )
]


rule report:
    input:
        tables=rules.aggregate.output,
        metrics=expand("results/runs/{run_id}/metrics.parquet", run_id=RUN_IDS),
        samples=expand("results/runs/{run_id}/samples.parquet", run_id=RUN_IDS),
        configs=expand("results/runs/{run_id}/config.json", run_id=RUN_IDS),
    # report(): the overview page and the figures are in `snakemake --report report.zip` too (docs/reference.md).
    output:
        html=report(REPORT_HTML, category="Report"),
        figures=[
            report(p, category="Figures")
            for p in REPORT_OUTPUTS
            if os.path.dirname(p) == REPORT_FIGURES
        ],
        pages=[p for p in REPORT_OUTPUTS if os.path.dirname(p) == REPORT_PAGES],
    log:
        f"{OUT}/logs/report.log",
    conda:
        "envs/marlflow.yaml"
    params:
        tables=lambda wildcards, input: os.path.dirname(input.tables[0]),
        figures=lambda wildcards, output: os.path.dirname(output.figures[0]),
        pages=lambda wildcards, output: (
            os.path.dirname(output.pages[0]) if output.pages else REPORT_PAGES
        ),
    shell:
        "python -m marlflow report --tables {params.tables:q} --runs {input.metrics:q}"
        " --figures {params.figures:q} --html {output.html:q} --pages {params.pages:q} > {log} 2>&1"
