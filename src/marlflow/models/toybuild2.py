"""Toy world v2's model build: two scales (`toy2s`, `toy2`) warm-started on the v2 corpus.

The same recipe as v1 (`marlflow.models.toybuild`: byte-level BPE, Qwen3 architecture, one shuffled SFT phase
of role-format and solving examples, fp32, 2 threads, measured on held-out problems), with v2's tasks
(toy_math, toy_code2) and corpus (`marlflow.models.warmstart2`: role conflict, the edge case) and a model
shape per scale (SHAPES). The design is docs/toy-world-v2.md. v1's sources are left as they are, so the
shipped v1 model (scale `toy`) and its evidence stay valid; v2's version hashes v1's sources too, because v2
builds on them.

    python -m marlflow.models.toybuild2 --scale toy2 --out src/marlflow/models/toy2_model [--seed 0]
    python -m marlflow models prepare --scale toy2s --model toy2s --out results/models/toy2s   # copies the shipped one
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import torch

from marlflow.models import toybuild
from marlflow.models.toybuild import BATCH_SIZE, LR, SOLVE_MIX, SOLVE_STEPS, STEPS, THREADS, log
from marlflow.store.atomic import atomic_write_json

VERSION = 2
SCALES = ("toy2s", "toy2")
# Two capacities, each <= 5 MB in fp32 (docs/toy-world-v2.md): toy2 is v1's shape (~0.86 M parameters),
# toy2s about half of it. Both keep head_dim 32 and tied embeddings.
SHAPES = {
    "toy2": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2},
    "toy2s": {"hidden_size": 96, "intermediate_size": 288, "num_hidden_layers": 4, "num_attention_heads": 3,
              "num_key_value_heads": 1},
}  # fmt: skip
SHIPPED = {scale: Path(__file__).parent / f"{scale}_model" for scale in SCALES}
SOLVE_TASK_SHARE = {"toy_math": 0.8, "toy_code2": 0.2}
_SOURCES = (*toybuild._TOY_SOURCES, "models/toybuild2.py", "models/warmstart2.py", "tasks/toy2.py")


def toy_version() -> str:
    """16 hex digits of the SHA-256 of v1's and v2's toy sources (imports left out, as v1's)."""
    root = Path(__file__).resolve().parents[1]
    text = b"".join(toybuild.toy_source_text((root / f).read_text()) for f in _SOURCES)
    return hashlib.sha256(text).hexdigest()[:16]


def toy_model(tok, seed: int, scale: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if scale not in SHAPES:
        raise ValueError(f"toy world v2 has scales {SCALES}, not {scale!r}")
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **SHAPES[scale],
    )
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def build_toy(out: str | Path, scale: str = "toy2", seed: int = 0, steps: int = STEPS,
              batch_size: int = BATCH_SIZE, lr: float = LR, eval_n: int = 200, solve_steps: int = SOLVE_STEPS,
              threads: int = THREADS, bf16: bool = False) -> dict:  # fmt: skip
    """Build, warm-start, save and measure a v2 toy model of `scale`; returns what warmstart.json records.
    The settings mean what they mean in `marlflow.models.toybuild.build_toy`."""
    from marlflow.core.config import TaskSpec
    from marlflow.models.warmstart2 import TASKS, build_examples, measure
    from marlflow.tasks import get_task

    for name, value in (("steps", steps), ("batch_size", batch_size), ("threads", threads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"toy build: {name} must be a positive integer, got {value!r}")
    torch.set_num_threads(threads)
    t0 = time.time()
    log(f"v2 {scale}: corpus and tokenizer (seed {seed}, {steps + solve_steps} steps x {batch_size})")
    rng, n = random.Random(seed), steps * batch_size
    examples, solving = [], []
    for name in TASKS:  # train problems only; the test split stays unseen
        task = get_task(name)
        problems = task.load("train", TaskSpec(name=name))
        examples += build_examples(task, problems, max(n // 2, 64), rng)
        n_solve = int(solve_steps * batch_size * SOLVE_TASK_SHARE[name])
        solving += build_examples(task, problems, n_solve, rng, SOLVE_MIX) if n_solve else []
    tok = toybuild.train_tokenizer(toybuild._texts(examples + solving))
    rows = toybuild.encode(tok, examples)
    model = toy_model(tok, seed, scale)
    t_data = time.time() - t0
    log(f"v2 {scale}: {len(examples) + len(solving)} examples, vocabulary {len(tok)}; warm start")
    phases = [(rows + (toybuild.encode(tok, solving) if solving else []), steps + solve_steps)]
    default_attn = model.config._attn_implementation
    model.set_attn_implementation("eager" if bf16 else default_attn)
    try:
        losses = toybuild.warm_start(model, phases, tok.pad_token_id, batch_size, lr, seed, bf16=bf16)
    finally:
        model.set_attn_implementation(default_attn)
    build_s = time.time() - t0
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    t1 = time.time()
    log(f"v2 {scale}: measuring every role on {eval_n} test problems per task")
    acc = measure(model, tok, eval_n, seed) if eval_n else {}
    info = {
        "world": VERSION,
        "scale": scale,
        "seed": seed,
        "steps": steps,
        "solve_steps": solve_steps,
        "batch_size": batch_size,
        "lr": lr,
        "threads": threads,
        "bf16_autocast": bf16,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tok),
        "corpus_examples": len(examples),
        "corpus_tokens": sum(len(r[0]) for r in rows),
        "data_seconds": round(t_data, 1),
        "build_seconds": round(build_s, 1),
        "measure_seconds": round(time.time() - t1, 1),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "eval_problems_per_task": eval_n,
        "accuracy": acc,
        "version": toy_version(),
        "torch": torch.__version__,
        "transformers": toybuild._transformers_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **toybuild.cpu_info(),
        "weights_sha256": toybuild.weights_sha256(model),
    }
    atomic_write_json(out / "warmstart.json", info)
    log(f"v2 {scale}: done in {time.time() - t0:.0f}s")
    return info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m marlflow.models.toybuild2", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--scale", choices=SCALES, default="toy2")
    toybuild.add_arguments(ap)
    a = ap.parse_args(argv)
    info = build_toy(a.out, scale=a.scale, seed=a.seed, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                     eval_n=a.eval_n, solve_steps=a.solve_steps, threads=a.threads, bf16=a.bf16)  # fmt: skip
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
