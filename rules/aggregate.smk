# All runs -> tidy summary tables (peak/terminal/cliff, failure signatures, gradient dynamics, seed CIs,
# contrasts, claims). The output list is marlflow.aggregate.OUTPUTS itself, so rule and module agree.
from marlflow.aggregate import OUTPUTS as AGGREGATE_OUTPUTS


rule aggregate:
    input:
        metrics=expand("results/runs/{run_id}/metrics.parquet", run_id=RUN_IDS),
        done=expand("results/runs/{run_id}/DONE", run_id=RUN_IDS),
    output:
        expand("results/tables/{name}", name=AGGREGATE_OUTPUTS),
    log:
        "results/logs/aggregate.log",
    conda:
        "envs/marlflow.yaml"
    shell:
        "python -m marlflow.aggregate --runs {input.metrics} --out results/tables > {log} 2>&1"
