"""Model weights in and out: loading base models and adapters, the shipped toy model, and trained runs.

`loading`: load a model and tokenizer by scale (toy, smol, hub ids), attach LoRA adapters, `prepare` a
model folder (the `marlflow models` command's library); `toybuild` and `warmstart`: how the toy model in
`toy_model/` was built and measured; `runs`: open a finished or half-finished run folder (its config,
checkpoints, per-policy models) for `marlflow eval` and `marlflow chat`.

May import: store, core, tasks, workflows (the toy build trains on the workflows' own prompts).
"""
