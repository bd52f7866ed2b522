# One model folder per scale: toy/smol are built locally, hub scales get a validated pointer.
rule models:
    output:
        "results/models/{scale}/READY",
    log:
        "results/logs/models/{scale}.log",
    conda:
        "envs/marlflow.yaml"
    params:
        model=lambda wildcards: MODELS[wildcards.scale],
    shell:
        "python -m marlflow.models prepare --scale {wildcards.scale} --model {params.model:q}"
        " --out results/models/{wildcards.scale} > {log} 2>&1"
