"""Validate marlflow.pipeline.plan's memory model on the CPU: saved-tensor fit, and measured chunk peaks vs predicted.

    python benchmarks/bench_plan_memory.py fit                 # ACT_COEF: bytes per token per layer, exact fit
    python benchmarks/bench_plan_memory.py validate [--repeats 3] [--cap-gb 6]   # >= 6 configurations
    python benchmarks/bench_plan_memory.py table [--cap-gb 6]  # Qwen3-0.6B widths, S = 1k..8k, old vs new
    python benchmarks/bench_plan_memory.py tokens [--steps 1]  # tokens per step: planned vs logged, toy + smol
    python benchmarks/bench_plan_memory.py logged [RUN ...]    # every logged toy evidence step (and RUNs)
    python benchmarks/bench_plan_memory.py process [--repeats 3] [--fit-set] [--allocator glibc mmap64k]

`process` measures whole trainer processes (VmHWM: build_trainer, then three update() calls) with glibc's
defaults, every MALLOC_* / GLIBC_TUNABLES variable removed from the child's environment (mmap64k, a labelled
comparison, sets MALLOC_MMAP_THRESHOLD_=65536), against marlflow.pipeline.plan.cpu_process_peak.

`fit` counts the tensors one decoder layer saves for backward (torch.autograd.graph.saved_tensors_hooks, distinct
storages, parameters skipped) on random models of varied widths with LoRA on every linear layer, and fits bytes
per token per layer as a linear function of the widths (marlflow.pipeline.plan.ACT_COEF). bf16 uses transformers' SDPA
(the CUDA path); fp32 uses the trainer's CPU attention (marlflow.generation.fastgen.use_gqa_sdpa).

`validate` and `table` measure the real peak of one forward-backward chunk through the trainer's own path:
`MultiAgentGRPOTrainer.update` on one slot's calls (collate -> TRL `_compute_loss` -> backward -> clip ->
AdamW), built by `marlflow.cli.train.build_trainer` from a RunConfig. Each configuration runs in its own subprocess
under `prlimit --as` (one at a time); the child does one warm-up update (AdamW's moments exist afterwards, as
in a running job), resets the high-water mark (`echo 5 > /proc/self/clear_refs`) and reports VmHWM minus VmRSS
before the measured update. glibc is told to mmap every allocation above 64 KiB (MALLOC_MMAP_THRESHOLD_), so
freed tensors leave RSS and the warm-up's memory is not silently reused. The prediction is
`marlflow.pipeline.plan.chunk_activation_bytes` for the same model, calls, width and device (activations + mask + head):
what a chunk adds on top of the resident model, adapters and optimizer.

Models: toy (built into /tmp by marlflow.models.toybuild with a short warm start), smol (results/models/smol, `make
smol-setup`), and random models of Qwen3-0.6B's widths (marlflow.pipeline.plan.HUB_SHAPES: hidden 1024, intermediate
3072, 16/8 heads, head_dim 128) with 1-2 layers, the real vocabulary (151,936) and SmolLM2's tokenizer (token
ids < 49,152). Threads: 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(tempfile.gettempdir()) / "marlflow-bench-plan"


# ------------------------------------------------------------------------------------------ fit (saved tensors)


def saved_bytes(arch, h, i, nh, nkv, hd, layers, r, dtype, seq=64, gqa=False) -> int:
    """Bytes of distinct non-parameter storages saved for backward by a forward of a random model."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from marlflow.generation.fastgen import use_gqa_sdpa

    cls = transformers.Qwen3Config if arch == "qwen3" else transformers.LlamaConfig
    cfg = cls(
        vocab_size=512,
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=layers,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=hd,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    if gqa:
        use_gqa_sdpa(model)
    lora = LoraConfig(
        r=r, lora_alpha=2 * r, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, lora)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    ids = torch.randint(0, 512, (1, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.base_model.model.model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return sum(seen.values())


FIT_POINTS = [
    ("qwen3", 1024, 3072, 16, 8, 128, 64),
    ("qwen3", 2048, 6144, 16, 8, 128, 64),
    ("qwen3", 2560, 9728, 32, 8, 128, 64),
    ("qwen3", 1024, 3072, 16, 8, 128, 8),
    ("qwen3", 512, 3072, 16, 8, 128, 64),
    ("qwen3", 1024, 1024, 16, 8, 128, 64),
    ("qwen3", 1024, 3072, 8, 8, 128, 64),
    ("qwen3", 1024, 3072, 16, 4, 128, 64),
    ("qwen3", 1024, 3072, 16, 8, 64, 64),
    ("llama", 576, 1536, 9, 3, 64, 8),
    ("llama", 1152, 1536, 9, 3, 64, 8),
    ("llama", 576, 3072, 9, 3, 64, 8),
    ("llama", 576, 1536, 18, 3, 64, 8),
    ("llama", 576, 1536, 9, 9, 64, 8),
    ("llama", 576, 1536, 9, 3, 64, 32),
    ("qwen3", 128, 384, 4, 2, 32, 8),
]
TERMS = ["h", "i", "q", "kv", "heads", "kv_heads", "r", "qk_norm", "const"]


def fit() -> None:
    import numpy as np
    import torch

    from marlflow.pipeline.plan import ACT_COEF, ModelShape

    torch.set_num_threads(1)
    for dtype, gqa in (("bfloat16", False), ("float32", True)):
        xs, ys = [], []
        for arch, h, i, nh, nkv, hd, r in FIT_POINTS:
            seq = 64
            args = (arch, h, i, nh, nkv, hd)
            dt = getattr(torch, dtype)
            y = (saved_bytes(*args, 2, r, dt, seq, gqa) - saved_bytes(*args, 1, r, dt, seq, gqa)) / seq
            qk = arch == "qwen3"
            xs.append([h, i, nh * hd, nkv * hd, nh, nkv, r, qk * (nh + nkv) * hd, 1])
            ys.append(y)
        coef, *_ = np.linalg.lstsq(np.array(xs, float), np.array(ys), rcond=None)
        pred = np.array(xs, float) @ coef
        print(
            f"{dtype} ({'trainer CPU attention' if gqa else 'transformers sdpa'}): "
            + ", ".join(f"{t} {c:.2f}" for t, c in zip(TERMS, coef))
            + f"; max |residual| {np.abs(pred - ys).max():.2f} B over {len(ys)} models"
        )
        for (arch, h, i, nh, nkv, hd, r), y in list(zip(FIT_POINTS, ys))[:3]:
            s = ModelShape(h, 28, i, nh, nkv, hd, 151936, True, arch == "qwen3")
            print(
                f"  {h}/{i}/{nh}/{nkv} r={r}: measured {y / 1024:.1f} KiB, ACT_COEF "
                f"{s.act_bytes_per_token_layer(dtype, r) / 1024:.1f} KiB"
            )
        print(f"  ACT_COEF[{dtype!r}] = {ACT_COEF[dtype]}")


# ------------------------------------------------------------------------------------------ measured peaks


def _random_qwen06(layers: int) -> Path:
    """A random model of Qwen3-0.6B's widths with `layers` layers and the full vocabulary, saved with SmolLM2's
    tokenizer (ids < 49,152) so the trainer can load it like any local model."""
    import torch
    import transformers

    from marlflow.pipeline.plan import HUB_SHAPES

    out = WORK / f"qwen06w-{layers}l"
    if (out / "config.json").is_file():
        return out
    # rope_theta: transformers' default, which the measurements in benchmarks/RESULTS.md were taken with (it
    # changes no tensor's size, so no memory figure).
    shape = dataclasses.replace(HUB_SHAPES["Qwen/Qwen3-0.6B"], layers=layers)
    cfg = shape.hf_config(rope_theta=10_000.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tok = transformers.AutoTokenizer.from_pretrained(ROOT / "results/models/smol")
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _toy() -> Path:
    out = WORK / "toy"
    if not (out / "config.json").is_file():
        from marlflow.models.toybuild import build_toy

        build_toy(out, seed=0, steps=40, batch_size=16, eval_n=0, solve_steps=0)
    return out


def model_path(name: str) -> Path:
    if Path(name).is_absolute() and (Path(name) / "config.json").is_file():  # a model folder (the tests' toy)
        return Path(name)
    if name == "toy":
        return _toy()
    if name == "smol":
        p = ROOT / "results/models/smol"
        if not (p / "config.json").is_file():
            raise SystemExit("results/models/smol is missing: build it with `make smol-setup`")
        return p
    if name.startswith("qwen06w-"):
        return _random_qwen06(int(name.split("-")[1].rstrip("l")))
    raise SystemExit(f"unknown model {name!r}")


def make_cfg(model: str, calls: int, ckpt: bool, lora_r: int, max_chunk_tokens: int = 0,
             generation_dtype: str = "model", workflow: str = "voting"):  # fmt: skip
    from marlflow.core.config import GRPOParams, RunConfig, TaskSpec

    fields = {"gradient_checkpointing": "on" if ckpt else "off"}
    return RunConfig(
        run_id=f"{workflow}-sp-toy-math-s0",
        workflow=workflow,
        sharing="sp",
        scale="toy",
        task_axis="math",
        seed=0,
        task=TaskSpec(name="toy_math", eval_size=2, train_size=20),
        model=model,
        generation_dtype=generation_dtype,
        micro_batch_size=calls,
        max_chunk_tokens=max_chunk_tokens,
        grpo=GRPOParams(
            steps=2,
            problems_per_step=1,
            group_size=2,
            learning_rate=1e-4,
            warmup_steps=0,
            lr_scheduler="constant",
            eval_every=1,
            lora_r=lora_r,
            lora_alpha=lora_r,
            max_prompt_length=65536,
            max_completion_length=65536,
        ),
        **fields,
    )


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _random_calls(spec: dict, tokenizer, call_cls) -> tuple[list, object]:
    """`spec["calls"]` calls of one slot with random token ids, and their advantages (N,)."""
    import torch

    vocab = min(tokenizer.vocab_size, 49152) - 10
    g = torch.Generator().manual_seed(0)
    calls = []
    for k in range(spec["calls"]):
        # Distinct prompts (no shared-prefix path), lengths mixed when the spec says so: the padding mask.
        p = spec["prompt"] - (k * spec["prompt"] // (2 * spec["calls"]) if spec.get("mixed") else 0)
        c = call_cls(f"generator{0}", "generator", [])
        c.prompt_ids = torch.randint(3, vocab, (p,), generator=g).tolist()
        c.completion_ids = torch.randint(3, vocab, (spec["completion"],), generator=g).tolist()
        calls.append(c)
    return calls, torch.linspace(-1, 1, len(calls)) + 0.01


def child(spec: dict) -> dict:
    """One configuration: build the trainer, one warm-up update, then the measured update's peak."""
    import gc

    import torch

    from marlflow.cli.train import build_trainer
    from marlflow.workflows import Call

    torch.set_num_threads(1)
    cfg = make_cfg(str(model_path(spec["model"])), spec["calls"], spec["ckpt"], spec["lora_r"])
    trainer = build_trainer(cfg, WORK / "run")
    model = trainer.model
    ckpt_on = bool(getattr(model.base_model.model, "is_gradient_checkpointing", False))
    calls, adv = _random_calls(spec, trainer.tokenizer, Call)
    trainer.update(calls, adv)  # warm-up: AdamW moments, TRL's lazy state
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    trainer.update(calls, adv)
    peak = _status("VmHWM")
    return {
        "delta_gb": (peak - before) / 1e9,
        "rss_before_gb": before / 1e9,
        "hwm_gb": peak / 1e9,
        "checkpointing_active": ckpt_on,
    }


def predict(spec: dict) -> float:
    from marlflow.pipeline.plan import chunk_activation_bytes, model_shape

    shape = model_shape(str(model_path(spec["model"])))
    width = spec["prompt"] + spec["completion"]
    b = chunk_activation_bytes(shape, "float32", spec["lora_r"], spec["calls"], width, spec["ckpt"], "cpu")
    if not spec.get("mixed") and spec["calls"] > 1:
        b["mask"] = 0.0  # equal lengths: collate builds no padding, so SDPA gets no mask  # noqa: ERA001
    return sum(b.values()) / 1e9


AS_HEADROOM_GB = 10.0
CACHE = WORK / "measured.jsonl"  # every measurement, appended: `--reuse` re-predicts without re-measuring


def measure(spec: dict, cap_gb: float, reuse: bool = False) -> dict:
    key = json.dumps({"mixed": False, **{k: v for k, v in spec.items() if k != "name"}}, sort_keys=True)
    if reuse and CACHE.is_file():
        for line in CACHE.read_text().splitlines():
            rec = json.loads(line)
            if rec["key"] == key and rec.get("n", 0) == reuse:
                return rec["result"]
    result = _measure(spec, cap_gb)
    if "delta_gb" in result:
        with CACHE.open("a") as fh:
            fh.write(json.dumps({"key": key, "n": reuse, "result": result}) + "\n")
    return result


def _measure(spec: dict, cap_gb: float) -> dict:
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    # The cap is on address space, which runs ~5-8 GB above resident memory once torch and TRL are imported;
    # `cap_gb` bounds what is run (predicted resident peak), the address-space limit adds that headroom.
    cmd = [
        "prlimit",
        f"--as={int((cap_gb + AS_HEADROOM_GB) * 1e9)}",
        sys.executable,
        __file__,
        "child",
        json.dumps(spec),
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [x for x in res.stdout.splitlines() if x.startswith("{")]
    if res.returncode != 0 or not lines:
        tail = (res.stderr or "").strip().splitlines()[-1:] or [f"exit code {res.returncode}"]
        over = "memory" in tail[0].lower() or "alloc" in tail[0].lower() or res.returncode < 0
        return {"error": f"over the {cap_gb:g} GB cap ({tail[0][:80]})" if over else tail[0][:200]}
    return json.loads(lines[-1])


VALIDATE = [
    {
        "name": "toy, 32 calls x 160, no ckpt",
        "model": "toy",
        "calls": 32,
        "prompt": 136,
        "completion": 24,
        "ckpt": False,
        "lora_r": 8,
        "mixed": True,
    },
    {
        "name": "toy, 32 calls x 160, ckpt",
        "model": "toy",
        "calls": 32,
        "prompt": 136,
        "completion": 24,
        "ckpt": True,
        "lora_r": 8,
        "mixed": True,
    },
    {
        "name": "smol, 4 calls x 256, no ckpt",
        "model": "smol",
        "calls": 4,
        "prompt": 208,
        "completion": 48,
        "ckpt": False,
        "lora_r": 8,
        "mixed": True,
    },
    {
        "name": "smol, 1 call x 1024, ckpt",
        "model": "smol",
        "calls": 1,
        "prompt": 768,
        "completion": 256,
        "ckpt": True,
        "lora_r": 64,
    },
    {
        "name": "smol, 1 call x 1024, no ckpt",
        "model": "smol",
        "calls": 1,
        "prompt": 768,
        "completion": 256,
        "ckpt": False,
        "lora_r": 64,
    },
    {
        "name": "Qwen3-0.6B widths 2 layers, 1 call x 1024, no ckpt",
        "model": "qwen06w-2l",
        "calls": 1,
        "prompt": 768,
        "completion": 256,
        "ckpt": False,
        "lora_r": 64,
    },
    {
        "name": "Qwen3-0.6B widths 2 layers, 1 call x 1024, ckpt",
        "model": "qwen06w-2l",
        "calls": 1,
        "prompt": 768,
        "completion": 256,
        "ckpt": True,
        "lora_r": 64,
    },
    {
        "name": "Qwen3-0.6B widths 2 layers, 4 calls x 512 mixed, no ckpt",
        "model": "qwen06w-2l",
        "calls": 4,
        "prompt": 384,
        "completion": 128,
        "ckpt": False,
        "lora_r": 64,
        "mixed": True,
    },
    {
        "name": "Qwen3-0.6B widths 2 layers, 4 calls x 512 mixed, ckpt",
        "model": "qwen06w-2l",
        "calls": 4,
        "prompt": 384,
        "completion": 128,
        "ckpt": True,
        "lora_r": 64,
        "mixed": True,
    },
]


def validate(repeats: int, cap_gb: float, only: list[str] | None = None) -> None:
    print(f"{_machine()}; cap {cap_gb:g} GB (prlimit --as); median of {repeats} runs")
    print(
        "| configuration | measured GB (median; range) | predicted GB | predicted / measured | ckpt active |"
    )
    print("|---|---|---|---|---|")
    for spec in VALIDATE:
        if only and not any(o in spec["name"] for o in only):
            continue
        pred = predict(spec)
        if pred > 0.8 * cap_gb:
            print(
                f"| {spec['name']} | over the {cap_gb:g} GB cap (not run) | {pred:.3f} | - | - |", flush=True
            )
            continue
        runs = [measure(spec, cap_gb, reuse=k + 1) for k in range(repeats)]
        ok = [r["delta_gb"] for r in runs if "delta_gb" in r]
        pred = predict(spec)
        if not ok:
            print(f"| {spec['name']} | {runs[0]['error']} | {pred:.3f} | - | - |", flush=True)
            continue
        med = statistics.median(ok)
        print(
            f"| {spec['name']} | {med:.3f} ({min(ok):.3f}-{max(ok):.3f}) | {pred:.3f} | {pred / med:.2f} | "
            f"{runs[0]['checkpointing_active']} |",
            flush=True,
        )


# ------------------------------------------------------------------------------------------ whole-process peaks

# Configurations for `process`. FIT_PROCESS set MEMORY["cpu_runtime_gb"] (the process's resident memory beyond
# its model, adapters and optimizer) and MEMORY["cpu_heap_retained"] (what glibc's heap keeps of earlier chunks);
# PROCESS are the others, which the planner never saw. "gen": the run's generation_dtype ("bfloat16": the hf
# backend's BF16Copy exists); "budget": max_chunk_tokens (0: none). The runs are Single (one slot), so that the
# planner's per-slot gradients are the ones the measured update keeps.
FIT_PROCESS = [
    {"name": "toy, 8 calls x 64, no ckpt", "model": "toy", "calls": 8, "prompt": 48, "completion": 16,
     "ckpt": False, "lora_r": 8, "mixed": True, "gen": "model"},
    {"name": "toy, 16 calls x 256, ckpt", "model": "toy", "calls": 16, "prompt": 192, "completion": 64,
     "ckpt": True, "lora_r": 8, "mixed": True, "gen": "model"},
    {"name": "smol, 4 calls x 256, no ckpt", "model": "smol", "calls": 4, "prompt": 208, "completion": 48,
     "ckpt": False, "lora_r": 8, "mixed": True, "gen": "model"},
]  # fmt: skip
PROCESS = [
    {"name": "toy, 32 calls x 160, no ckpt, bf16 copy", "model": "toy", "calls": 32, "prompt": 136,
     "completion": 24, "ckpt": False, "lora_r": 16, "mixed": True, "gen": "bfloat16"},
    {"name": "toy, 24 calls x 320, no ckpt", "model": "toy", "calls": 24, "prompt": 256, "completion": 64,
     "ckpt": False, "lora_r": 8, "mixed": True, "gen": "model"},
    {"name": "smol, 1 call x 1024, ckpt, bf16 copy", "model": "smol", "calls": 1, "prompt": 768,
     "completion": 256, "ckpt": True, "lora_r": 64, "gen": "bfloat16"},
    {"name": "smol, 2 calls x 512, no ckpt, bf16 copy", "model": "smol", "calls": 2, "prompt": 384,
     "completion": 128, "ckpt": False, "lora_r": 16, "mixed": True, "gen": "bfloat16"},
    {"name": "smol, 8 calls x 128, ckpt", "model": "smol", "calls": 8, "prompt": 96, "completion": 32,
     "ckpt": True, "lora_r": 8, "mixed": True, "gen": "model"},
    {"name": "smol, 16 calls x 96, no ckpt", "model": "smol", "calls": 16, "prompt": 72, "completion": 24,
     "ckpt": False, "lora_r": 8, "mixed": True, "gen": "model"},
    {"name": "Qwen3-0.6B widths 2 layers, 1 call x 512, ckpt, bf16 copy", "model": "qwen06w-2l", "calls": 1,
     "prompt": 384, "completion": 128, "ckpt": True, "lora_r": 64, "gen": "bfloat16"},
]  # fmt: skip
# glibc's malloc settings that would hide what a real run's allocator does: `process` removes them, and sets
# MALLOC_MMAP_THRESHOLD_ only for the allocator it names "mmap64k" (a comparison, labelled as such).
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
              "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")  # fmt: skip
PROCESS_CACHE = WORK / "process.jsonl"  # every `process` measurement, appended: `--reuse` re-predicts


def process_child(spec: dict) -> dict:
    """The whole process through the trainer's own path: `build_trainer` (model, adapters, optimizers, the hf
    backend with its bf16 sampling copy when spec["gen"] asks for it), then `spec["updates"]` updates of the same
    calls. Returns VmHWM of the process (its peak since it started), VmRSS after the build and after each update,
    each update's seconds, and the glibc malloc variables it saw."""
    import time

    import torch

    from marlflow.cli.train import build_trainer
    from marlflow.workflows import Call

    torch.set_num_threads(1)
    seen = {k: os.environ[k] for k in MALLOC_ENV if k in os.environ}
    cfg = make_cfg(str(model_path(spec["model"])), spec["calls"], spec["ckpt"], spec["lora_r"],
                   spec.get("budget", 0), spec.get("gen", "model"), "single")  # fmt: skip
    trainer = build_trainer(cfg, WORK / "run-process")
    rss = [_status("VmRSS")]
    calls, adv = _random_calls(spec, trainer.tokenizer, Call)
    seconds = []
    for _ in range(spec.get("updates", 3)):
        t0 = time.perf_counter()
        trainer.update(calls, adv)
        seconds.append(time.perf_counter() - t0)
        rss.append(_status("VmRSS"))
    return {
        "hwm_gb": _status("VmHWM") / 1e9,
        "rss_gb": [r / 1e9 for r in rss],
        "update_s": seconds,
        "malloc_env": seen,
        "bf16_copy": trainer.backend.bf16 is not None,
    }


def predict_process(spec: dict) -> dict:
    """The planner's whole-process CPU peak for `spec`'s chunk (marlflow.pipeline.plan.cpu_process_peak), GB."""
    from marlflow.pipeline.plan import Chunk, cpu_process_peak, model_shape

    path = str(model_path(spec["model"]))
    cfg = make_cfg(path, spec["calls"], spec["ckpt"], spec["lora_r"], spec.get("budget", 0),
                   spec.get("gen", "model"), "single")  # fmt: skip
    chunk = Chunk("generator0", spec["calls"], spec["prompt"] + spec["completion"], spec["prompt"])
    return cpu_process_peak(cfg, model_shape(path), chunk, spec["ckpt"])


def run_process(spec: dict, allocator: str, reuse: int = 0) -> dict:
    """One `process_child` in a fresh interpreter with none of MALLOC_ENV set: allocator "glibc" (glibc's
    defaults, what a run has) or "mmap64k" (MALLOC_MMAP_THRESHOLD_=65536: freed tensors leave at once, for
    comparison). reuse = k > 0: the k-th cached measurement of the same spec and allocator, when there is one."""
    key = json.dumps(
        {"spec": {k: v for k, v in spec.items() if k != "name"}, "allocator": allocator}, sort_keys=True
    )
    if reuse and PROCESS_CACHE.is_file():
        hits = [json.loads(x) for x in PROCESS_CACHE.read_text().splitlines()]
        hits = [h["result"] for h in hits if h["key"] == key]
        if len(hits) >= reuse:
            return hits[reuse - 1]
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if allocator == "mmap64k":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, __file__, "process-child", json.dumps(spec)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [x for x in res.stdout.splitlines() if x.startswith("{")]
    if res.returncode != 0 or not lines:
        tail = (res.stderr or "").strip().splitlines()[-1:] or [f"exit code {res.returncode}"]
        return {"error": tail[0][:200]}
    out = json.loads(lines[-1])
    if allocator == "glibc" and out["malloc_env"]:
        raise SystemExit(f"the child saw {out['malloc_env']}: the measurement would not be a real run's")
    WORK.mkdir(parents=True, exist_ok=True)
    with PROCESS_CACHE.open("a") as fh:
        fh.write(json.dumps({"key": key, "result": out}) + "\n")
    return out


def process(
    repeats: int,
    allocators: list[str],
    only: list[str] | None = None,
    fit_set: bool = False,
    reuse: bool = False,
) -> None:
    """Measured VmHWM of whole trainer processes against the planner's prediction (`predict_process`)."""
    specs = FIT_PROCESS if fit_set else PROCESS
    print(f"{_machine()}; median of {repeats} runs; no MALLOC_* variable in the environment except where the "
          "allocator is mmap64k (MALLOC_MMAP_THRESHOLD_=65536)")  # fmt: skip
    print("| configuration | allocator | measured peak GB (median; range) | RSS after build GB | predicted GB | "
          "predicted / measured | update s | predicted parts GB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for spec in specs:
        if only and not any(o in spec["name"] for o in only):
            continue
        pred = predict_process(spec)
        parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in pred["parts"].items() if v)
        by_alloc: dict[str, list] = {a: [] for a in allocators}
        for k in range(repeats):  # interleaved, so that the update times compare
            for alloc in allocators:
                by_alloc[alloc].append(run_process(spec, alloc, k + 1 if reuse else 0))
        for alloc, runs in by_alloc.items():
            ok = [r for r in runs if "hwm_gb" in r]
            if not ok:
                print(f"| {spec['name']} | {alloc} | {runs[0]['error']} | - | - | - | - | - |", flush=True)
                continue
            hwm = [r["hwm_gb"] for r in ok]
            med = statistics.median(hwm)
            build = statistics.median(r["rss_gb"][0] for r in ok)
            # Updates after the first (which also creates AdamW's moments), pooled over the runs.
            secs = statistics.median(x for r in ok for x in r["update_s"][1:])
            print(f"| {spec['name']} | {alloc} | {med:.3f} ({min(hwm):.3f}-{max(hwm):.3f}) | {build:.3f} | "
                  f"{pred['peak'] / 1e9:.3f} | {pred['peak'] / 1e9 / med:.2f} | {secs:.2f} | {parts} |",
                  flush=True)  # fmt: skip


def table(cap_gb: float, budget: int) -> None:
    """Qwen3-0.6B widths at S = 1k..8k: old defaults (32 calls, no ckpt) vs new (token budget, ckpt), and one call
    per chunk with and without checkpointing. Measured where the prediction is under 80% of the cap."""
    from marlflow.core.algos import token_budget_chunks
    from marlflow.pipeline.plan import HUB_SHAPES, chunk_activation_bytes

    print(f"{_machine()}; cap {cap_gb:g} GB")
    print(
        "| S | setting | calls/chunk | measured GB, 2-layer model (CPU fp32) | predicted GB, same | "
        "predicted GB, 28 layers CPU fp32 | predicted GB, 28 layers CUDA bf16 |"
    )
    print("|---|---|---|---|---|---|---|")
    full = HUB_SHAPES["Qwen/Qwen3-0.6B"]
    for s in (1024, 2048, 4096, 8192):
        for label, ckpt, tokens in (
            ("old: 32 calls, no ckpt", False, 0),
            (f"new: {budget} tokens, ckpt", True, budget),
            ("budget = S (1 call), ckpt", True, s),
            ("1 call, no ckpt", False, s),
        ):
            calls = max(len(c) for c in token_budget_chunks([s] * 32, 32, tokens))
            spec = {
                "model": "qwen06w-2l",
                "calls": calls,
                "prompt": s - s // 4,
                "completion": s // 4,
                "ckpt": ckpt,
                "lora_r": 64,
                "mixed": calls > 1,
            }
            pred = predict(spec)
            big_cpu = sum(chunk_activation_bytes(full, "float32", 64, calls, s, ckpt, "cpu").values()) / 1e9
            big_gpu = (
                sum(chunk_activation_bytes(full, "bfloat16", 64, calls, s, ckpt, "cuda", s // 4).values())
                / 1e9
            )
            if pred > cap_gb * 0.8:
                got = f"over the {cap_gb:g} GB cap (not run)"
            else:
                r = measure(spec, cap_gb, reuse=1)
                got = r.get("error") or f"{r['delta_gb']:.2f}"
            print(
                f"| {s:,} | {label} | {calls} | {got} | {pred:.2f} | {big_cpu:.1f} | {big_gpu:.1f} |",
                flush=True,
            )


def tokens(steps: int) -> None:
    """Planned vs logged tokens per step on real runs: the toy preset's four workflows (SP, its real settings,
    the /tmp toy model) and smol's Voting SP math, `steps` steps each. The planner gets what only the run can
    know: each role's logged mean completion length, Eval-Opt's continuation and Orch-Workers' worker count
    and strategy length (the policy decides those); prompts, carried answers and call counts are its own."""
    import pandas as pd
    import torch

    from marlflow import workflows
    from marlflow.cli.train import build_trainer
    from marlflow.core.config import RunConfig
    from marlflow.pipeline import plan
    from marlflow.pipeline.matrix import run_sheet

    torch.set_num_threads(1)
    cases = [("toy", f"{w}-sp-toy-math-s0", _toy()) for w in ("single", "eval_opt", "voting", "orch_workers")]
    cases.append(("smol", "voting-sp-smol-math-s0", ROOT / "results/models/smol"))
    print(f"{_machine()}; {steps} step(s) per run")
    print(
        "| run | role | calls planned / logged | prompt tokens planned / logged | completion tokens planned / "
        "logged | total error |"
    )
    print("|---|---|---|---|---|---|")
    for preset, rid, model in cases:
        d = json.loads(run_sheet(ROOT / "matrix.yaml", preset).loc[rid, "config"])
        cfg = RunConfig.from_dict({**d, "model": str(model)})
        trainer = build_trainer(cfg, WORK / f"tokens-{rid}")
        for step in range(1, steps + 1):
            seen = []

            def spy(*args, _real=workflows.rollout, _seen=seen, **kwargs):
                out = _real(*args, **kwargs)
                _seen.extend(out)
                return out

            real, workflows.rollout = (
                workflows.rollout,
                spy,
            )  # marlflow.training.rollout.train_episodes calls it
            try:
                trainer.train_step(step)
            finally:
                workflows.rollout = real
            m = pd.DataFrame(trainer.metric_rows)
            m = m[(m.split == "train") & (m.role != "all") & (m.step == step)]
            m = m.pivot_table(index="role", columns="metric", values="value")
            eps = cfg.grpo.problems_per_step * cfg.grpo.group_size
            comp = {r: m.loc[r, "tokens"] / m.loc[r, "samples"] for r in m.index}
            frac, workers, strategy = 1.0, None, None
            if cfg.workflow == "eval_opt":
                rounds = cfg.eval_opt_rounds or 3
                lo, hi = 0.0, 1.0
                for _ in range(60):
                    mid = (lo + hi) / 2
                    lo, hi = (
                        (mid, hi)
                        if eps * sum(mid**k for k in range(rounds)) < m.loc["generator", "samples"]
                        else (lo, mid)
                    )
                frac = lo
            if cfg.workflow == "orch_workers":
                workers = m.loc["worker", "samples"] / eps
                texts = [x for e in seen for x in e.info["strategies"]]
                tok = trainer.tokenizer
                strategy = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts) / len(texts)
            slots = plan.slot_tokens(cfg, comp, continue_frac=frac, workers=workers, strategy=strategy)
            for role in m.index:
                mine = [x for x in slots if x.role == role]
                pc, pp, pt = (
                    sum(x.calls for x in mine),
                    sum(x.prompt_tokens for x in mine),
                    sum(x.completion_tokens for x in mine),
                )
                lc, lp, lt = m.loc[role, "samples"], m.loc[role, "prompt_tokens"], m.loc[role, "tokens"]
                err = (pp + pt) / (lp + lt) - 1
                print(
                    f"| {rid} step {step} | {role} | {pc} / {lc:.0f} | {pp:,.0f} / {lp:,.0f} | {pt:,.0f} / {lt:,.0f} | "
                    f"{err:+.1%} |",
                    flush=True,
                )


def logged(runs: list[str]) -> None:
    """Planned vs logged tokens per step on every train step of the committed toy evidence
    (results/evidence/toy/metrics.parquet, the toy preset's 14 runs; their configs from the current run sheet)
    and of any run folder given (RUN/config.json + RUN/metrics.parquet, e.g. smol runs), each step planned with
    what that step logged (marlflow.pipeline.plan.behaviour_from_metrics: per-role mean completion,
    continuation, workers); then the behaviour the toy runs showed, for BEHAVIOUR's defaults. No training."""
    import pandas as pd

    from marlflow.core.config import RunConfig
    from marlflow.pipeline import plan
    from marlflow.pipeline.matrix import run_sheet

    ev = pd.read_parquet(ROOT / "results/evidence/toy/metrics.parquet")
    sheet = run_sheet(ROOT / "matrix.yaml", "toy")
    cases = [(rid, RunConfig.from_dict(json.loads(sheet.loc[rid, "config"])), g)
             for rid, g in ev.groupby("run_id")]  # fmt: skip
    for r in runs:
        cfg = RunConfig.from_dict(json.loads((Path(r) / "config.json").read_text()))
        cases.append((cfg.run_id, cfg, plan.run_metrics(r)))
    print("| run | steps | planned / logged tokens per step: median (range) | steps within 10% |")
    print("|---|---|---|---|")
    shown = []
    for rid, cfg, m in cases:
        ratios = []
        for step in sorted(m[m.split == "train"].step.unique()):
            ms = m[m.step == step]
            b = plan.behaviour_from_metrics(cfg, ms)
            slots = plan.slot_tokens(cfg, **b.tokens_kw())
            planned = sum(x.prompt_tokens + x.completion_tokens for x in slots)
            t = ms[(ms.split == "train") & (ms.role != "all") & ms.metric.isin(["tokens", "prompt_tokens"])]
            ratios.append(planned / t.value.sum())
            shown.append((rid, cfg, step, b))
        inside = sum(abs(x - 1) <= 0.10 for x in ratios)
        print(f"| {rid} | {len(ratios)} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) "
              f"| {inside} / {len(ratios)} |", flush=True)  # fmt: skip
    print("\n| toy run | continuation: mean (step range) | workers per episode: mean (step range) | "
          "mean completion / cap by role | eval completion cv by role (median) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for rid, cfg, m in cases[: len(sheet)]:
        bs = [b for r, _, _, b in shown if r == rid]
        cont = [b.continue_frac for b in bs]
        work = [b.workers for b in bs if b.workers is not None]
        t = m[(m.split == "train") & (m.role != "all")].pivot_table(index="role", columns="metric", values="value",
                                                                     aggfunc="sum")  # fmt: skip
        cap = cfg.grpo.max_completion_length
        share = {r: t.loc[r, "tokens"] / t.loc[r, "samples"] / cap for r in t.index}
        e = m[(m.split == "eval") & (m.role != "all")].pivot_table(index=["step", "role"], columns="metric",
                                                                    values="value")  # fmt: skip
        cv = (e["completion_length_sd"] / e["completion_length"]).groupby("role").median()
        fmt = lambda xs: f"{statistics.mean(xs):.3f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"  # noqa: E731
        print(f"| {rid} | {fmt(cont) if spec_rounds(cfg) else '-'} | {fmt(work)} | "
              + ", ".join(f"{r} {v:.2f}" for r, v in share.items()) + " | "
              + ", ".join(f"{r} {v:.2f}" for r, v in cv.items()) + " |")  # fmt: skip


def spec_rounds(cfg) -> bool:
    from marlflow.core.workflow_spec import spec_of

    return bool(spec_of(cfg.workflow).default_rounds)


def _machine() -> str:
    """harness.environment(): CPU, cores, kernels, torch, threads, commit (benchmarks/ is on sys.path when this
    runs as a script; imported here so that tests can load the module's functions without it)."""
    from harness import environment

    return environment()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fit")
    v = sub.add_parser("validate")
    v.add_argument("--repeats", type=int, default=3)
    v.add_argument("--cap-gb", type=float, default=6.0)
    v.add_argument("--only", nargs="*", help="substrings of configuration names")
    t = sub.add_parser("table")
    t.add_argument("--cap-gb", type=float, default=6.0)
    t.add_argument("--budget", type=int, default=32768, help="max_chunk_tokens of the new defaults")
    k = sub.add_parser("tokens")
    k.add_argument("--steps", type=int, default=1)
    lg = sub.add_parser("logged")
    lg.add_argument("runs", nargs="*", help="run folders to check too (config.json + metrics.parquet)")
    pr = sub.add_parser("process", help="whole-process peaks (VmHWM) of trainers vs the planner")
    pr.add_argument("--repeats", type=int, default=3)
    pr.add_argument(
        "--allocator",
        nargs="+",
        default=["glibc"],
        choices=["glibc", "mmap64k"],
        help="glibc: its defaults, as runs have them; mmap64k: MALLOC_MMAP_THRESHOLD_=65536 (comparison)",
    )
    pr.add_argument("--reuse", action="store_true", help="re-predict cached measurements (PROCESS_CACHE)")
    pr.add_argument("--only", nargs="*", help="substrings of configuration names")
    pr.add_argument(
        "--fit-set", action="store_true", help="the configurations MEMORY's cpu_* constants came from"
    )
    c = sub.add_parser("child")
    c.add_argument("spec")
    pc = sub.add_parser("process-child")
    pc.add_argument("spec")
    args = ap.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    if args.cmd == "fit":
        fit()
    elif args.cmd == "validate":
        validate(args.repeats, args.cap_gb, args.only)
    elif args.cmd == "tokens":
        tokens(args.steps)
    elif args.cmd == "logged":
        logged(args.runs)
    elif args.cmd == "table":
        table(args.cap_gb, args.budget)
    elif args.cmd == "process":
        process(args.repeats, args.allocator, args.only, args.fit_set, args.reuse)
    elif args.cmd == "process-child":
        print(json.dumps(process_child(json.loads(args.spec))))
    else:
        print(json.dumps(child(json.loads(args.spec))))


if __name__ == "__main__":
    main()
