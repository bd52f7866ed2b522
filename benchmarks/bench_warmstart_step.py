"""One toy warm-start step (batch 32) in fp32 and under bf16 autocast, SDPA and eager attention (issue 12).

    PYTHONPATH=src python benchmarks/bench_warmstart_step.py [--threads 2] [--steps 25] [--reps 3]

Builds the toy corpus and tokenizer as `marlflow.toybuild` does (a smaller corpus), then times `--steps` optimizer
steps of each variant on the same length-bucketed batches, `--reps` rounds with the variants interleaved, and
prints milliseconds per step per round. It also prints the machine's fp32 matmul rate on the model's shapes,
because the toy build is compute-bound and its time follows that rate from machine to machine; and whether torch
sees a CPU with native bf16 (without it, bf16 autocast is emulated and slower than fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import torch

from marlflow import toybuild as tb
from marlflow.config import TaskSpec
from marlflow.tasks import get_task
from marlflow.warmstart import build_examples


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=25, help="steps per variant per round")
    ap.add_argument("--reps", type=int, default=3, help="rounds, variants interleaved within each")
    a = ap.parse_args(argv)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    print(
        f"fp32 matmul GFLOP/s: 1 thread {matmul_gflops(1):.1f}, {a.threads} threads {matmul_gflops(a.threads):.1f}"
    )
    torch.set_num_threads(a.threads)
    rng, examples, solving = random.Random(0), [], []
    for name in tb.TOY_TASKS:
        task = get_task(name)
        problems = task.load("train", TaskSpec(name=name))
        examples += build_examples(task, problems, 2000, rng)
        solving += build_examples(task, problems, 3000, rng, tb.SOLVE_MIX)
    tok = tb.train_tokenizer(tb._texts(examples + solving))
    rows = tb.encode(tok, examples + solving)
    batches = tb._length_batches(rows, 32, random.Random(0))
    need = a.steps * a.reps
    if len(batches) < need:
        raise SystemExit(f"only {len(batches)} batches for {need} steps; lower --steps or --reps")
    variants = [(attn, bf16) for attn in ("sdpa", "eager") for bf16 in (False, True)]
    models = {}
    for attn, bf16 in variants:
        m = tb.toy_model(tok, 0)
        m.set_attn_implementation(attn)
        m.train()
        models[attn, bf16] = (m, torch.optim.AdamW(m.parameters(), lr=1e-3))
    ms = {v: [] for v in variants}
    for rep in range(a.reps):
        for v in variants:
            m, opt = models[v]
            t = time.perf_counter()
            for s in range(a.steps):
                ids, mask, labels = tb._batch([rows[i] for i in batches[rep * a.steps + s]], tok.pad_token_id)
                amp = torch.autocast("cpu", dtype=torch.bfloat16) if v[1] else contextlib.nullcontext()
                with amp:
                    loss = tb.completion_loss(m, ids, mask, labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
            ms[v].append((time.perf_counter() - t) / a.steps * 1000)
    for (attn, bf16), vals in ms.items():
        rounds = ", ".join(f"{x:.0f}" for x in vals)
        print(
            f"{attn:5s} {'bf16' if bf16 else 'fp32'}: ms per step (batch 32, {a.threads} threads) per round: {rounds}"
        )


if __name__ == "__main__":
    main()
