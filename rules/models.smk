# One model folder per scale and toy build: toy is copied from the model shipped in src/marlflow/models/toy_model/
# after its weights hash is checked (or built here when toy_build gives other settings or --build, or for a
# build b > 0 of the `build` axis: `--seed b` into results/models/<scale>-b<b>; the same for every toy scale,
# marlflow.core.config.TOY_SCALES: toy, toy2s, toy2), smol is converted locally, hub
# scales get a validated pointer. The whole folder is the output, because what `prepare` writes differs by
# scale (toy: weights, tokenizer, warmstart.json; hub scales: READY only); READY, written last, records what
# was prepared.
rule models:
    output:
        directory("results/models/{folder}"),
    log:
        "results/logs/models/{folder}.log",
    conda:
        "envs/marlflow.yaml"
    params:
        scale=lambda wildcards: MODEL_FOLDERS[wildcards.folder]["scale"],
        model=lambda wildcards: MODEL_FOLDERS[wildcards.folder]["model"],
        # Toy build options from a profile's or the command line's config (`toy_build: "--seed 1"`,
        # `--config toy_build=--build`): settings other than the shipped model's, or --build, build a toy model
        # here instead of copying the shipped one. Empty by default; other scales ignore it. A build b > 0
        # adds `--seed b` (common.smk refuses a toy_build that sets --seed as well).
        toy_build=lambda wildcards: toy_build_options(wildcards.folder),
    shell:
        "python -m marlflow models prepare --scale {params.scale} --model {params.model:q}"
        " --out {output:q} {params.toy_build} > {log} 2>&1"
