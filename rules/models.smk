# One model folder per scale: toy/smol are built locally, hub scales get a validated pointer.
# The whole folder is the output, because what `prepare` writes differs by scale (toy: weights, tokenizer,
# warmstart.json; hub scales: READY only); READY, written last, records what was prepared.
rule models:
    output:
        directory("results/models/{scale}"),
    log:
        "results/logs/models/{scale}.log",
    conda:
        "envs/marlflow.yaml"
    params:
        model=lambda wildcards: MODELS[wildcards.scale],
        # Toy build options from a profile's config (`toy_build: "--steps 40 ..."`): CI's SLURM smoke
        # checks plumbing, not learning, so it builds a small toy model. Empty by default; other scales ignore it.
        toy_build=config.get("toy_build", ""),
    shell:
        "python -m marlflow.models prepare --scale {wildcards.scale} --model {params.model:q}"
        " --out {output:q} {params.toy_build} > {log} 2>&1"
