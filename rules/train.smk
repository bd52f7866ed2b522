# One training run per row of the run sheet.


# Writing a small JSON file is not worth a cluster job.
localrules:
    run_config,


rule run_config:
    output:
        config="results/runs/{run_id}/config.json",
    log:
        "results/logs/run_config/{run_id}.log",
    conda:
        "envs/marlflow.yaml"
    params:
        # The whole config as a param: Snakemake reruns a run when its cell of matrix.yaml changes,
        # and only that run.
        config=lambda wildcards: SHEET.loc[wildcards.run_id, "config"],
    # A shell job, not `run:`: Snakemake starts a whole new Snakemake process for each local `run:` job
    # (about 10 s here), while json.tool imports nothing. The temporary file and `mv` keep the write atomic.
    shell:
        "printf '%s' {params.config:q} | python -m json.tool --indent 2 --sort-keys > {output.config:q}.tmp"
        " && mv {output.config:q}.tmp {output.config:q} && echo wrote {output.config:q} > {log:q}"


# Outputs are what `python -m marlflow train` writes (its docstring; tests/test_rules.py checks a real run
# against them). RUN/checkpoints/ is deliberately not an output: it is the job's resume state, and
# Snakemake deletes a job's outputs before it runs and after it fails, which would throw away exactly
# what a rerun resumes from. Nor is RUN/environment.jsonl (marlflow.training.environment): each attempt appends the
# machine it starts on, and deleting it would lose the machines of the attempts before.
# update(): a finished run that is retrained (its cell edited, or -R) keeps its metrics, samples, outcomes and final/
# while the new attempt runs: the trainer replaces them only at its end, atomically, and Snakemake restores them if
# the attempt fails (a failed start leaves the previous results as they were). DONE is not kept: a run whose
# retraining failed is unfinished, and the next `snakemake` trains it again instead of taking the old results for
# the new config. The Snakefile's onstart clears the copies a killed Snakemake leaves (pipeline.snake).
rule train:
    input:
        config="results/runs/{run_id}/config.json",
        model=model_folder,
    output:
        metrics=update("results/runs/{run_id}/metrics.parquet"),
        samples=update("results/runs/{run_id}/samples.parquet"),
        outcomes=update("results/runs/{run_id}/outcomes.parquet"),
        final=update(directory("results/runs/{run_id}/final")),
        done="results/runs/{run_id}/DONE",
    log:
        "results/logs/train/{run_id}.log",
    benchmark:
        "results/benchmarks/train/{run_id}.tsv"
    priority: lambda wildcards: PRIORITY[wildcards.run_id]
    conda:
        "envs/marlflow.yaml"
    # CPU-only defaults; GPUs, memory and time per scale come from a profile's `scale_resources`.
    # runtime never depends on `attempt`: a resubmitted job (exit 75 after a checkpoint) gets the same limit.
    # A run of N ranks (RunConfig.ranks) is one job of N SLURM tasks, each with cpus_per_task CPUs and (on
    # GPUs) one GPU, and mem_mb per rank; the trainer starts the ranks itself (srun inside the job, torchrun
    # without SLURM; marlflow.training.distributed.launch_argv). tasks_per_gpu 1: SLURM's executor would otherwise give
    # each GPU `tasks` tasks.
    resources:
        gpu=scale_resource("gpu", 0),
        tasks=lambda wildcards: run_ranks(SHEET, wildcards.run_id),
        tasks_per_gpu=1,
        # scale_resources.<scale>.nodes: K spreads the ranks over K nodes (sbatch --nodes); one node by default.
        nodes=scale_resource("nodes", 1),
        cpus_per_task=scale_resource(
            "cpus_per_task", lambda wildcards, threads: threads
        ),
        mem_mb=lambda wildcards, threads: int(
            scale_resource("mem_mb", 4000)(wildcards, threads)
        )
        * run_ranks(SHEET, wildcards.run_id),
        runtime=scale_resource("runtime", 120),
    params:
        run_dir=lambda wildcards, output: os.path.dirname(output.done),
    # `exec`: the trainer replaces the rule's bash, so a SIGTERM (scancel, preemption) that SLURM sends to every
    # process of the job step reaches the trainer without killing a shell in between; the step's Snakemake
    # waits for it while it checkpoints (exit 75, marlflow.training.preempt). Without it, bash died of SIGTERM and
    # Snakemake ended the step with the trainer still saving (docs/environment.md, "Preemption"). A run of N
    # ranks: that process is the ranks' launcher; it waits for them and exits with the run's code, 75 included
    # (marlflow.training.distributed.launch).
    # --log: the trainer writes its own log, keeping an earlier attempt's (a killed, resumed job) as
    # LOG.attempt-N instead of overwriting it.
    shell:
        "exec python -m marlflow train --config {input.config:q} --out {params.run_dir:q} --log {log:q}"
