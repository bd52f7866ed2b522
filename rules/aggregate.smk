# All runs of the preset (or slice) -> tidy summary tables (peak/terminal/cliff, failure signatures, gradient dynamics, seed CIs,
# contrasts, claims, the pooled interventions). The output list is marlflow.analysis.aggregate.OUTPUTS itself, so rule and module agree.
import json

from marlflow.analysis.aggregate import OUTPUTS as AGGREGATE_OUTPUTS
from marlflow.pipeline.matrix import analysis_of

# The preset's analyses declared before its runs (matrix.yaml `analysis:`, validated by marlflow.pipeline.matrix), as
# JSON for `marlflow.analysis.aggregate --analysis`; a params change reruns the rule.
AGGREGATE_ANALYSIS = json.dumps(
    analysis_of(config["matrix"], config.get("preset")), sort_keys=True
)


rule aggregate:
    input:
        metrics=expand("results/runs/{run_id}/metrics.parquet", run_id=RUN_IDS),
        done=expand("results/runs/{run_id}/DONE", run_id=RUN_IDS),
        outcomes=expand("results/runs/{run_id}/outcomes.parquet", run_id=RUN_IDS),
    # OUT (rules/common.smk): results/ for the default preset in full, else the preset's or slice's own folder.
    # report(): the tables readers open (csv, md, tex) are in `snakemake --report report.zip` too.
    output:
        [
            p if p.endswith(".parquet") else report(p, category="Tables")
            for p in expand("{out}/tables/{name}", out=OUT, name=AGGREGATE_OUTPUTS)
        ],
    log:
        f"{OUT}/logs/aggregate.log",
    conda:
        "envs/marlflow.yaml"
    params:
        tables=lambda wildcards, output: os.path.dirname(output[0]),
        analysis=AGGREGATE_ANALYSIS,
    shell:
        "python -m marlflow aggregate --runs {input.metrics} --out {params.tables:q} --analysis {params.analysis:q} > {log} 2>&1"
