"""Evaluation rollouts through the hf backend's generation paths: HF `generate` vs marlflow's own decode loop.

    .venv/bin/python benchmarks/bench_decode.py [--model results/models/toy] [--reps 3] [--threads 1]
        [--quick]   # tiny mode (benchmarks/harness.py): 1 round of the first run

For each toy run of the matrix (workflow x task x SP/IP), builds the trainer once and times one evaluation
rollout (the preset's 200 problems, T = 0.7, one fixed seed) under three paths, `--reps` rounds interleaved:

- `generate`: the path before this change: each distinct prompt prefilled once, then HF `generate` with that
  cache, and transformers' "sdpa" attention (grouped K/V heads copied to every query head under a mask);
- `loop`: `marlflow.generation.fastgen.sample` (generate's tokens, finished rows dropped) with the GQA attention;
- `loop+kv`: the default: `loop` plus the reuse of earlier calls' K/V (`PrefixKV`).

The store is cleared before every rollout (as after the weight update that precedes every evaluation), so no
rollout reuses another's states. Prints the median seconds of each path, the ratios to `generate`, and each
path's eval accuracy (a sanity check: the paths differ only by float rounding, so they agree or nearly).
"""

from __future__ import annotations

import tempfile
from functools import partial

import torch
from harness import eval_rollout, interleaved, medians, parser, setup, toy_configs

from marlflow.cli.train import build_trainer
from marlflow.generation.fastgen import GQA_SDPA, prefill_cache
from marlflow.generation.hf import trim_completion
from marlflow.generation.sampling import distinct_rows

PATHS = ("generate", "loop", "loop+kv")


def _generate_before(backend):
    """The hf backend's generate before the decode loop: shared prefill, then HF generate on that cache."""

    @torch.no_grad()
    def generate(policy, prompts, sampling, seeds=None):
        model = backend.bf16.weights(policy) if backend.bf16 is not None else backend.model
        if backend.bf16 is None:
            model.set_adapter(policy)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), backend.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        first, inv = distinct_rows(map(tuple, prompts))
        kwargs = dict(
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=backend.pad_id,
            eos_token_id=list(backend.eos_ids),
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,
        )
        if len(first) < len(prompts) and width > 1:
            kwargs["past_key_values"] = prefill_cache(model, ids, mask, first, inv)
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        return [trim_completion(g, backend.eos_ids) for g in out[:, width:].tolist()]

    return generate


def _models(trainer):
    backend = trainer.backend
    return [trainer.model] + ([backend.bf16.model] if backend.bf16 is not None else [])


def _set_path(trainer, path: str, hf_generate, store) -> None:
    backend = trainer.backend
    for m in _models(trainer):
        m.set_attn_implementation("sdpa" if path == "generate" else GQA_SDPA)
    if path == "generate":
        backend.generate = hf_generate
    else:
        backend.__dict__.pop("generate", None)  # the class's method
    backend.prefix_kv = store if path == "loop+kv" else None
    backend.on_update()


def _evaluate(trainer, path, hf_generate, store) -> float:
    _set_path(trainer, path, hf_generate, store)
    return eval_rollout(trainer.cfg, trainer, trainer.cfg.seed + 1)


def main(argv=None) -> None:
    args = setup(parser(__doc__).parse_args(argv))
    print(f"median of {args.reps} interleaved rounds")
    print(
        "| run | generate s | loop s | loop+kv s | loop / generate | loop+kv / generate | accuracy (3 paths) |"
    )
    print("|---|---|---|---|---|---|---|")
    totals = {p: 0.0 for p in PATHS}
    configs = toy_configs(args)
    for run_id, cfg in list(configs.items())[: 1 if args.quick else None]:
        trainer = build_trainer(cfg, tempfile.mkdtemp())
        hf_generate, store = _generate_before(trainer.backend), trainer.backend.prefix_kv
        variants = {p: partial(_evaluate, trainer, p, hf_generate, store) for p in PATHS}
        times, acc = interleaved(variants, args.reps)
        med = medians(times)
        for p in PATHS:
            totals[p] += med[p]
        print(
            f"| {run_id} | {med['generate']:.2f} | {med['loop']:.2f} | {med['loop+kv']:.2f} | "
            f"{med['loop'] / med['generate']:.2f} | {med['loop+kv'] / med['generate']:.2f} | "
            f"{', '.join(f'{acc[p]:.3f}' for p in PATHS)} |",
            flush=True,
        )
    g = totals["generate"]
    print(
        f"| all {len(configs) if not args.quick else 1} runs | {g:.2f} | {totals['loop']:.2f} | "
        f"{totals['loop+kv']:.2f} | {totals['loop'] / g:.2f} | {totals['loop+kv'] / g:.2f} | |"
    )


if __name__ == "__main__":
    main()
