# Tables + per-run metrics -> figures and one self-contained HTML report.
rule report:
    input:
        tables=rules.aggregate.output,
        metrics=expand("results/runs/{run_id}/metrics.parquet", run_id=RUN_IDS),
    output:
        curves="results/figures/curves.png",
        html="results/report.html",
    log:
        "results/logs/report.log",
    conda:
        "envs/marlflow.yaml"
    shell:
        "python -m marlflow.report --tables results/tables --runs {input.metrics}"
        " --figures results/figures --html {output.html} > {log} 2>&1"
