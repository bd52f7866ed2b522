# One model folder per scale: toy is copied from the model shipped in src/marlflow/toy_model/ after its weights
# hash is checked (or built here when toy_build gives other settings or --build), smol is converted locally,
# hub scales get a validated pointer. The whole folder is the output, because what `prepare` writes differs by
# scale (toy: weights, tokenizer, warmstart.json; hub scales: READY only); READY, written last, records what
# was prepared.
rule models:
    output:
        directory("results/models/{scale}"),
    log:
        "results/logs/models/{scale}.log",
    conda:
        "envs/marlflow.yaml"
    params:
        model=lambda wildcards: MODELS[wildcards.scale],
        # Toy build options from a profile's or the command line's config (`toy_build: "--seed 1"`,
        # `--config toy_build=--build`): settings other than the shipped model's, or --build, build a toy model
        # here instead of copying the shipped one. Empty by default; other scales ignore it.
        toy_build=config.get("toy_build", ""),
    shell:
        "python -m marlflow.models prepare --scale {wildcards.scale} --model {params.model:q}"
        " --out {output:q} {params.toy_build} > {log} 2>&1"
