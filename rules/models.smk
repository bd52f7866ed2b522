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
    shell:
        "python -m marlflow.models prepare --scale {wildcards.scale} --model {params.model:q}"
        " --out {output:q} > {log} 2>&1"
