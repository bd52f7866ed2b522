# One training run per row of the run sheet.


# Writing a small JSON file is not worth a cluster job.
localrules:
    run_config,


rule run_config:
    output:
        config="results/runs/{run_id}/config.json",
    log:
        "results/logs/run_config/{run_id}.log",
    params:
        # The whole config as a param: Snakemake reruns a run when its cell of matrix.yaml changes,
        # and only that run.
        config=lambda wildcards: SHEET.loc[wildcards.run_id, "config"],
    run:
        write_config(params.config, output.config, log[0])


rule train:
    input:
        config="results/runs/{run_id}/config.json",
        model=lambda wildcards: f"results/models/{run_scale(wildcards)}/READY",
    output:
        metrics="results/runs/{run_id}/metrics.parquet",
        samples="results/runs/{run_id}/samples.parquet",
        done="results/runs/{run_id}/DONE",
    log:
        "results/logs/train/{run_id}.log",
    conda:
        "envs/marlflow.yaml"
    # CPU-only defaults; GPUs, memory and time per scale come from a profile's `scale_resources`.
    resources:
        gpu=scale_resource("gpu", 0),
        cpus_per_task=scale_resource(
            "cpus_per_task", lambda wildcards, threads: threads
        ),
        mem_mb=scale_resource("mem_mb", 4000),
        runtime=scale_resource("runtime", 120),
    shell:
        "python -m marlflow.train --config {input.config} --out results/runs/{wildcards.run_id} > {log} 2>&1"
