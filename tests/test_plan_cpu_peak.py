"""The whole CPU training process's peak against the planner, with glibc's malloc as runs have it.

The planner's CPU peak (marlflow.pipeline.plan.cpu_process_peak) is runtime + weights + adapters and AdamW + the
hf backend's bf16 sampling copy + the largest chunk + what glibc's heap keeps of earlier chunks. Every
measurement runs in a fresh subprocess (benchmarks/bench_plan_memory.py process-child) with no MALLOC_*
variable set, so neither this process's memory nor a tuned allocator counts. Run:
`pytest -q tests/test_plan_cpu_peak.py` (about a minute).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from marlflow.core.config import RunConfig
from marlflow.pipeline import plan

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks/bench_plan_memory.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_plan_memory", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_planner_counts_the_bf16_sampling_copy():
    """generation_dtype bfloat16 (hf backend) adds 2 bytes per parameter to the CPU peak, "model" nothing; the
    CPU process's runtime is counted on the CPU and not on CUDA."""
    bench = _bench()
    shape = plan.HUB_SHAPES["Qwen/Qwen3-0.6B"]
    chunk = plan.Chunk("generator0", 4, 64, 48)
    peaks = {}
    for gen in ("bfloat16", "model"):
        cfg = bench.make_cfg("Qwen/Qwen3-0.6B", 4, False, 8, generation_dtype=gen, workflow="single")
        peaks[gen] = plan.cpu_process_peak(cfg, shape, chunk, False)
    assert peaks["bfloat16"]["parts"]["sampling_copy"] == 2 * shape.params
    assert peaks["model"]["parts"]["sampling_copy"] == 0
    assert peaks["bfloat16"]["peak"] - peaks["model"]["peak"] >= 2 * shape.params
    assert peaks["model"]["parts"]["runtime"] == plan.MEMORY["cpu_runtime_gb"] * plan.GB
    cuda = RunConfig.from_dict({**cfg.to_dict(), "device": "cuda", "generation_dtype": "auto"})
    gpu = plan.plan_run(cuda, "h100-80gb")
    assert gpu.memory["runtime"] == 0 and gpu.memory["sampling_copy"] == 0


# Not in benchmarks/bench_plan_memory.py's FIT_PROCESS (the cpu_* constants' fit) nor PROCESS: a toy update
# whose chunk (48 calls of up to 384 tokens, no checkpointing) is about half the process, with the bf16 copy.
UNSEEN = {"calls": 48, "prompt": 320, "completion": 64, "ckpt": False, "lora_r": 8, "mixed": True,
          "gen": "bfloat16", "updates": 2}  # fmt: skip


def test_whole_process_cpu_peak_within_25_percent_of_the_planner(toy_model_dir):
    """VmHWM of a trainer process (build, then two updates through `update()`) within +-25% of
    plan.cpu_process_peak, with no MALLOC_* variable in the child's environment."""
    bench = _bench()
    spec = {"name": "unseen", "model": str(toy_model_dir), **UNSEEN}
    env = {k: v for k, v in os.environ.items() if k not in bench.MALLOC_ENV}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, str(BENCH), "process-child", json.dumps(spec)], env=env,
                         capture_output=True, text=True, cwd=ROOT, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["malloc_env"] == {} and got["bf16_copy"], got
    pred = bench.predict_process(spec)
    chunk = sum(pred["parts"][k] for k in ("activations", "head", "heap_retained")) / 1e9
    assert chunk > 0.3 * pred["peak"] / 1e9, "the chunk should be a real part of the peak"
    ratio = pred["peak"] / 1e9 / got["hwm_gb"]
    assert 0.75 <= ratio <= 1.25, (ratio, got, {k: v / 1e9 for k, v in pred["parts"].items()})


def test_bench_process_never_sets_malloc_variables(monkeypatch, tmp_path):
    """`process` strips every glibc malloc variable before it starts a child, even one set here, and sets the
    mmap threshold only for the allocator it names mmap64k."""
    bench = _bench()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    monkeypatch.setattr(bench, "PROCESS_CACHE", tmp_path / "process.jsonl")
    monkeypatch.setattr(bench, "WORK", tmp_path)
    seen = {}

    def fake_run(cmd, env, **kw):
        seen.clear()
        seen.update(env)
        out = {"hwm_gb": 1.0, "malloc_env": {k: env[k] for k in bench.MALLOC_ENV if k in env}}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(out), stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    bench.run_process({"model": "toy"}, "glibc")
    assert not any(k in seen for k in bench.MALLOC_ENV)
    bench.run_process({"model": "toy"}, "mmap64k")
    assert seen["MALLOC_MMAP_THRESHOLD_"] == "65536" and "GLIBC_TUNABLES" not in seen
