"""One toy warm-start step (batch 32) in fp32 and under bf16 autocast, SDPA and eager attention.

    PYTHONPATH=src python benchmarks/bench_warmstart_step.py [--threads 2] [--steps 25] [--reps 3]
        [--quick]   # tiny mode (benchmarks/harness.py): 1 round of 2 steps on a tenth of the corpus

Builds the toy corpus and tokenizer as `marlflow.models.toybuild` does (a smaller corpus), then times `--steps` optimizer
steps of each variant on the same length-bucketed batches, `--reps` rounds with the variants interleaved, and
prints milliseconds per step per round. It also prints the machine's fp32 matmul rate on the model's shapes,
because the toy build is compute-bound and its time follows that rate from machine to machine; and whether torch
sees a CPU with native bf16 (without it, bf16 autocast is emulated and slower than fp32).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from functools import partial

import torch
from harness import interleaved, parser, setup

from marlflow.core.config import TaskSpec
from marlflow.models import toybuild as tb
from marlflow.models.warmstart import build_examples
from marlflow.tasks import get_task


def matmul_gflops(threads: int, n: int = 200) -> float:
    """fp32 GFLOP/s of a (2048 x 128) @ (128 x 384) matmul: the toy model's MLP shape at batch 32 x 64 tokens."""
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 128), torch.randn(128, 384)
    for _ in range(10):
        a @ b
    t = time.perf_counter()
    for _ in range(n):
        a @ b
    return 2 * 2048 * 128 * 384 * n / (time.perf_counter() - t) / 1e9


def _steps(model, opt, bf16: bool, batches, rows, tok, steps: int, rounds) -> None:
    """`steps` optimizer steps of one variant on the batches of its next round (every variant gets the same)."""
    rep = next(rounds)
    for s in range(steps):
        ids, mask, labels = tb._batch([rows[i] for i in batches[rep * steps + s]], tok.pad_token_id)
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with amp:
            loss = tb.completion_loss(model, ids, mask, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def main(argv=None) -> None:
    ap = parser(__doc__, model=None)
    ap.set_defaults(threads=2)
    ap.add_argument("--steps", type=int, default=25, help="steps per variant per round")
    a = setup(ap.parse_args(argv))
    if a.quick:
        a.steps = 2
    print(
        f"fp32 matmul GFLOP/s: 1 thread {matmul_gflops(1):.1f}, {a.threads} threads {matmul_gflops(a.threads):.1f}"
    )
    torch.set_num_threads(a.threads)
    rng, examples, solving = random.Random(0), [], []
    scale = 10 if a.quick else 1
    for name in tb.TOY_TASKS:
        task = get_task(name)
        problems = task.load("train", TaskSpec(name=name))
        examples += build_examples(task, problems, 2000 // scale, rng)
        solving += build_examples(task, problems, 3000 // scale, rng, tb.SOLVE_MIX)
    tok = tb.train_tokenizer(tb._texts(examples + solving))
    rows = tb.encode(tok, examples + solving)
    batches = tb._length_batches(rows, 32, random.Random(0))
    need = a.steps * a.reps
    if len(batches) < need:
        raise SystemExit(f"only {len(batches)} batches for {need} steps; lower --steps or --reps")
    variants = {}
    for attn in ("sdpa", "eager"):
        for bf16 in (False, True):
            m = tb.toy_model(tok, 0)
            m.set_attn_implementation(attn)
            m.train()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            name = f"{attn} {'bf16' if bf16 else 'fp32'}"
            variants[name] = partial(_steps, m, opt, bf16, batches, rows, tok, a.steps, itertools.count())
    times, _ = interleaved(variants, a.reps)
    for name, secs in times.items():
        rounds = ", ".join(f"{x / a.steps * 1000:.0f}" for x in secs)
        print(f"{name}: ms per step (batch 32, {a.threads} threads) per round: {rounds}")


if __name__ == "__main__":
    main()
