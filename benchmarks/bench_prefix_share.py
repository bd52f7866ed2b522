"""Forward-backward of G rollouts per prompt: every row recomputes its prompt vs the prompt computed once.

    .venv/bin/python benchmarks/bench_prefix_share.py [--model results/models/toy] [--reps 5] [--threads 1]
        [--quick]   # tiny mode (benchmarks/harness.py): 1 round of the shortest shape

What a GRPO update on the toy model costs per chunk of 32 calls (4 prompts x G=8, the trainer's chunk), and
what prefix sharing saves (the trainer's `_shared_prefix_logps`): "full" runs
each row's prompt + completion through the PEFT model (LoRA r 8, all linear layers) as TRL does; "shared"
runs each distinct prompt once with a KV cache, expands the cache to its G rows (index_select, so gradients
flow back into the prompt's computation) and runs only the completions. Both compute the same loss
(sum of advantage-weighted completion log-probs) and the same LoRA gradient, checked before timing; prompt
and completion lengths are those of the toy workflows' stages (single's 32-token prompt to Eval-Opt's last
~200-token history). Prints the median milliseconds of each over `--reps` interleaved rounds and the ratio.
"""

from __future__ import annotations

from functools import partial

import torch
from harness import interleaved, medians, parser, setup


def lora_model(path: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path)
    model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    )
    with torch.no_grad():  # a trained-looking adapter: fresh lora_B is zero and would hide mistakes
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model.train()


def full(model, prompts, comps, adv):
    """prompts (U, P), comps (U*G, C), adv (U*G,): -sum(adv * completion log-probs), every row in full."""
    g = comps.shape[0] // prompts.shape[0]
    ids = torch.cat([prompts.repeat_interleave(g, 0), comps], 1)
    logits = model(input_ids=ids).logits[:, prompts.shape[1] - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, comps.unsqueeze(-1)).squeeze(-1)
    return -(logp.sum(1) * adv).sum()


def shared(model, prompts, comps, adv):
    """The same loss with each prompt run once and its KV cache expanded to the prompt's G rows."""
    from transformers import DynamicCache

    u, p = prompts.shape
    g = comps.shape[0] // u
    cache = DynamicCache(config=model.config)
    first = model(input_ids=prompts, past_key_values=cache, use_cache=True).logits[:, -1:]
    rows = torch.arange(u).repeat_interleave(g)
    cache.reorder_cache(rows)
    pos = torch.arange(p, p + comps.shape[1] - 1).expand(comps.shape[0], -1)
    rest = model(input_ids=comps[:, :-1], past_key_values=cache, position_ids=pos, use_cache=True).logits
    logits = torch.cat([first[rows], rest], 1).float()
    logp = torch.log_softmax(logits, -1).gather(-1, comps.unsqueeze(-1)).squeeze(-1)
    return -(logp.sum(1) * adv).sum()


def grads(model, fn, *args) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = fn(model, *args)
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def main(argv=None) -> None:
    args = setup(parser(__doc__, reps=5).parse_args(argv))
    torch.manual_seed(0)
    model = lora_model(args.model)
    vocab = model.config.vocab_size
    print(f"4 prompts x G=8 per chunk, median of {args.reps} interleaved rounds")
    print(
        "| prompt tokens | completion tokens | full ms | shared ms | shared / full | max grad diff / max grad |"
    )
    print("|---|---|---|---|---|---|")
    shapes = ((32, 12), (40, 24), (90, 20), (150, 24), (200, 25))
    for p, c in shapes[: 1 if args.quick else None]:
        prompts = torch.randint(3, vocab, (4, p))
        comps = torch.randint(3, vocab, (32, c))
        adv = torch.randn(32)
        (lf, gf), (ls, gs) = (
            grads(model, full, prompts, comps, adv),
            grads(model, shared, prompts, comps, adv),
        )
        assert abs(lf - ls) <= 1e-4 * abs(lf), (lf, ls)
        rel = ((gf - gs).abs().max() / gf.abs().max()).item()
        assert rel < 1e-3, rel
        variants = {
            n: partial(grads, model, fn, prompts, comps, adv)
            for n, fn in (("full", full), ("shared", shared))
        }
        med = medians(interleaved(variants, args.reps)[0])
        f, s = med["full"], med["shared"]
        print(f"| {p} | {c} | {1000 * f:.1f} | {1000 * s:.1f} | {s / f:.2f} | {rel:.1e} |", flush=True)


if __name__ == "__main__":
    main()
