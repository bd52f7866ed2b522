# All runs -> tidy summary tables (peak/terminal/cliff, failure signatures, gradient dynamics).
rule aggregate:
    input:
        metrics=expand("results/runs/{run_id}/metrics.parquet", run_id=RUN_IDS),
        done=expand("results/runs/{run_id}/DONE", run_id=RUN_IDS),
    output:
        "results/tables/summary.parquet",
        "results/tables/summary.csv",
        "results/tables/summary.md",
        "results/tables/failures.csv",
        "results/tables/grad_dynamics.csv",
    log:
        "results/logs/aggregate.log",
    conda:
        "envs/marlflow.yaml"
    shell:
        "python -m marlflow.aggregate --runs {input.metrics} --out results/tables > {log} 2>&1"
