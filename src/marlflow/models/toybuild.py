"""The toy model build: tokenizer, ~1M-parameter Qwen3 model, supervised warm start, measurement.

Builds a ~0.86M-parameter Qwen3-architecture model with a byte-level BPE tokenizer trained here, and
warm-starts it by supervised fine-tuning on every role's output format for toy_math and toy_code (corpus:
`marlflow.models.warmstart`), so that RL starts from a base that is often right but noisy. `warmstart.json` records
the settings, phase times, each role's accuracy on held-out problems and a hash of the weights.

Train jobs never import this module: `marlflow.models.loading` loads models and calls `build_toy` only from
`prepare --scale toy`.

    python -m marlflow.models.toybuild --out results/models/toy [--seed 0] [--threads 2]
    python -m marlflow models build-toy --out results/models/toy          # the same, kept for old scripts

Speed (2-core CPU, benchmarks/RESULTS.md): the loss projects only completion positions (~1 in 4) onto the
vocabulary, which is exact and saves the lm_head matmul and log-softmax on prompt tokens. `--bf16` (matmuls
under bf16 autocast on AMX/AVX512-BF16, eager attention, fp32 master weights) was ~1.5x faster per example,
but together with batch 128 / lr 6e-3 / 450 steps it gave a generator that never answers right (math
generator 0.02 at T=0.7): the defaults stay the validated schedule, 1,800 fp32 steps at batch 32.

Determinism: the build fixes its own intra-op thread count (`threads`, default 2, recorded in
warmstart.json), so the environment's OMP/MKL settings do not change the weights. Given the seed, the
weights depend on that thread count, the torch version and the CPU's instruction set (oneDNN picks AMX,
AVX512 or AVX2 kernels, which round differently); `weights_sha256` in warmstart.json identifies them.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from marlflow.store.atomic import atomic_write_json

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, turn start, eos
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOY_TASKS = ("toy_math", "toy_code")
# The toy build depends on these sources (paths inside the marlflow package): any edit to what they do makes
# `prepare` rebuild the model. Import statements are left out of the hash (`toy_source_text`): they say where
# code lives, not what it does, so moving a module the builder imports does not make the shipped model stale.
_TOY_SOURCES = ("models/toybuild.py", "models/warmstart.py", "workflows/prompts.py", "tasks/toy.py")
# Defaults of the build: (steps + solve_steps) * batch_size = 57,600 examples seen. Measured: the same
# examples at batch 128, lr 6e-3 (450 steps, bf16) left every generator role near 0 accuracy.
STEPS, SOLVE_STEPS, BATCH_SIZE, LR, THREADS = 400, 1400, 32, 3e-3, 2


def toy_source_text(source: str) -> bytes:
    """`source` without its import statements (top-level or inside functions), as UTF-8 bytes.

    Lines are dropped by the line span the parser gives each import, which is the same on every Python
    version, so the version below is too."""
    lines = source.splitlines(keepends=True)
    drop = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            drop.update(range(node.lineno - 1, node.end_lineno))
    return "".join(line for i, line in enumerate(lines) if i not in drop).encode()


def toy_version() -> str:
    """16 hex digits of the SHA-256 of the toy sources' text, import statements left out."""
    root = Path(__file__).resolve().parents[1]  # the marlflow package
    return hashlib.sha256(
        b"".join(toy_source_text((root / f).read_text()) for f in _TOY_SOURCES)
    ).hexdigest()[:16]


def log(msg: str) -> None:
    """One progress line in the model-build job's log (Snakemake sends stderr there)."""
    print(f"[toy build {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- tokenizer, model


def train_tokenizer(texts: list[str], vocab_size: int = 768):
    """Byte-level BPE whose digits stay single tokens, so arithmetic is learnable digit by digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )


def toy_model(tok, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


# CPU features that decide which oneDNN/ATen kernels the build runs (and so its rounding, and its weights).
_KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                 "amx_int8")  # fmt: skip


def cpu_info() -> dict:
    """The building CPU's model name and its kernel-relevant flags (Linux /proc/cpuinfo; empty elsewhere)."""
    import platform

    name, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return {"cpu_model": name, "cpu_flags": [f for f in _KERNEL_FLAGS if f in flags]}


def weights_sha256(model) -> str:
    """sha256 over every tensor of the state dict (name, dtype, shape, bytes), in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ---------------------------------------------------------------- corpus encoding and batches


def encode(tok, examples) -> list[tuple[list[int], int]]:
    """(prompt + completion ids, prompt length) per example; the prompt is rendered exactly as at generation."""
    # Rendering ChatML directly is ~20x faster than the Jinja template; check that both agree.
    prompts = [_chatml(e.messages) + "<|im_start|>assistant\n" for e in examples]
    for e, p in zip(examples[:20], prompts):
        assert p == tok.apply_chat_template(e.messages, tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tok([e.target + tok.eos_token for e in examples], add_special_tokens=False)["input_ids"]
    return [(p + c, len(p)) for p, c in zip(p_ids, c_ids)]


def _batch(rows, pad_id: int):
    # Right padding is fine for training (positions start at 0); labels mask prompt and padding.
    # Widths rounded up to a multiple of 16: few distinct shapes keep CPU kernels warm.
    width = -(-max(len(ids) for ids, _ in rows) // 16) * 16
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (seq, n_prompt) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, n_prompt : len(seq)] = ids[i, n_prompt : len(seq)]
        mask[i, : len(seq)] = 1
    return ids, mask, labels


def _length_batches(rows, batch_size: int, rng: random.Random) -> list[list[int]]:
    # Batches of similar length (sorted within shuffled windows of 16 batches) waste little compute on
    # padding; role prompts range from ~50 to ~200 tokens. Measured: packing all rows of a batch into one
    # sequence (block-diagonal attention) was 2-3x slower per example than this on CPU.
    order = rng.sample(range(len(rows)), len(rows))
    window = batch_size * 16
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: len(rows[i][0]))
        batches += [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def completion_loss(model, ids, mask, labels):
    """Mean cross-entropy over completion tokens, the same value as `model(..., labels=labels).loss`.

    Only the positions that predict a completion token (~1 in 4) are projected onto the vocabulary, which
    saves most of the lm_head matmul and log-softmax; the logits are upcast to fp32 under bf16 autocast."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    target = labels[:, 1:]
    keep = target != -100
    logits = model.lm_head(hidden[:, :-1][keep]).float()
    return torch.nn.functional.cross_entropy(logits, target[keep])


def warm_start(model, phases, pad_id: int, batch_size: int, lr: float, seed: int, bf16: bool = False):
    """Plain SFT over `phases` [(rows, steps), ...]: AdamW, loss on completion tokens only. Each phase has
    its own schedule (linear warm-up, cosine decay), so a later phase is not stuck with a decayed rate.
    `bf16`: matmuls under bf16 autocast; weights, gradients and optimizer state stay fp32."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    model.train()
    losses, t0, total = [], time.time(), sum(n for _, n in phases)
    every = max(1, total // 10)
    for rows, steps in phases:
        batches = _length_batches(rows, batch_size, rng)
        warmup = max(1, steps // 20)
        for g in opt.param_groups:
            g["lr"] = lr
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s, n=steps, w=warmup: (
                min(1.0, (s + 1) / w) * 0.5 * (1 + math.cos(math.pi * min(s / n, 1.0)))
            ),
        )
        for step in range(steps):
            ids, mask, labels = _batch([rows[i] for i in batches[step % len(batches)]], pad_id)
            amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
            with amp:
                loss = completion_loss(model, ids, mask, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if len(losses) % every == 0 or len(losses) == total:
                recent = losses[-every:]
                log(f"warm start step {len(losses)}/{total} loss {sum(recent) / len(recent):.3f} "
                    f"{time.time() - t0:.0f}s")  # fmt: skip
    model.eval()
    return losses


# Extra examples of the solving roles (the task skill: reading numbers, doing arithmetic) are mixed into
# the role-format corpus; without them a ~1M model stays on the copy-from-prompt plateau within budget.
SOLVE_MIX = {"generator": 3.0, "worker": 1.5, "refinement": 0.5}
# Copying a description into code is learned far faster than arithmetic, so the extra examples are mostly math.
SOLVE_TASK_SHARE = {"toy_math": 0.8, "toy_code": 0.2}


def build_toy(out: str | Path, seed: int = 0, steps: int = STEPS, batch_size: int = BATCH_SIZE, lr: float = LR,
              eval_n: int = 200, solve_steps: int = SOLVE_STEPS, threads: int = THREADS,
              bf16: bool = False) -> dict:  # fmt: skip
    """Build, warm-start, save and measure the toy model; returns what warmstart.json records.

    `steps` optimizer steps of `batch_size` role-format examples and `solve_steps` more of solving examples
    (see SOLVE_MIX), shuffled into one phase. `threads` intra-op threads (the weights depend on it)."""
    from marlflow.core.config import TaskSpec
    from marlflow.models.warmstart import build_examples, measure
    from marlflow.tasks import get_task

    for name, value in (("steps", steps), ("batch_size", batch_size), ("threads", threads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"toy build: {name} must be a positive integer, got {value!r}")
    if solve_steps < 0 or eval_n < 0 or not lr > 0:
        raise ValueError(f"toy build: need solve_steps >= 0, eval_n >= 0, lr > 0 (got {solve_steps}, "
                         f"{eval_n}, {lr})")  # fmt: skip
    torch.set_num_threads(threads)
    t0 = time.time()
    log(f"phase 1/4: corpus and tokenizer (seed {seed}, {steps + solve_steps} steps x {batch_size})")
    rng, n = random.Random(seed), steps * batch_size
    examples, solving = [], []
    for name in TOY_TASKS:  # train problems only; the test split stays unseen
        task = get_task(name)
        problems = task.load("train", TaskSpec(name=name))
        examples += build_examples(task, problems, max(n // 2, 64), rng)
        n_solve = int(solve_steps * batch_size * SOLVE_TASK_SHARE[name])
        solving += build_examples(task, problems, n_solve, rng, SOLVE_MIX) if n_solve else []
    tok = train_tokenizer(_texts(examples + solving))
    rows = encode(tok, examples)
    model = toy_model(tok, seed)
    t_data = time.time() - t0
    log(f"phase 1/4 done in {t_data:.0f}s: {len(examples) + len(solving)} examples, vocabulary {len(tok)}")
    log(f"phase 2/4: warm start, {steps + solve_steps} steps ({threads} threads, bf16 matmuls: {bf16})")
    # One shuffled phase: training the solving skill first and the role formats after made the second
    # phase overwrite the first (measured: math generator 0.53 -> 0.10 greedy).
    phases = [(rows + (encode(tok, solving) if solving else []), steps + solve_steps)]
    # Under bf16, eager attention for training: its bf16 backward beat SDPA's on padded rows here (fp32:
    # SDPA is as fast). Generation and the saved config keep the default (SDPA).
    default_attn = model.config._attn_implementation
    model.set_attn_implementation("eager" if bf16 else default_attn)
    try:
        losses = warm_start(model, phases, tok.pad_token_id, batch_size, lr, seed, bf16=bf16)
    finally:
        model.set_attn_implementation(default_attn)
    build_s = time.time() - t0
    log("phase 3/4: save")
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    t1 = time.time()
    log(f"phase 4/4: measure every role on {eval_n} test problems per task" if eval_n else "phase 4/4: none")
    acc = measure(model, tok, eval_n, seed) if eval_n else {}
    info = {
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
        "completion_tokens": sum(len(r[0]) - r[1] for r in rows),
        "data_seconds": round(t_data, 1),
        "build_seconds": round(build_s, 1),
        "measure_seconds": round(time.time() - t1, 1),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "eval_problems_per_task": eval_n,
        "accuracy": acc,
        "version": toy_version(),
        "torch": torch.__version__,
        "transformers": _transformers_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **cpu_info(),
        "weights_sha256": weights_sha256(model),
    }
    atomic_write_json(out / "warmstart.json", info)
    total_s, warm_s = time.time() - t0, build_s - t_data
    log(f"done in {total_s:.0f}s (warm start {warm_s:.0f}s, measure {info['measure_seconds']}s)")
    return info


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _texts(examples) -> list[str]:
    # Train the BPE on message text without the chat markers, which are special tokens anyway.
    # Role names appear in every chat header; without them "assistant" would cost nine tokens per turn.
    roles = ["user assistant system"] * 1000
    return roles + [m["content"] for e in examples for m in e.messages] + [e.target for e in examples]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The toy build's options (shared with `python -m marlflow models`)."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=STEPS, help="warm-start steps on the role-format corpus")
    p.add_argument(
        "--solve-steps", type=int, default=SOLVE_STEPS, help="extra steps' worth of solving examples"
    )
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="examples per warm-start step")
    p.add_argument("--lr", type=float, default=LR, help="peak learning rate (warm-up, cosine decay)")
    p.add_argument("--threads", type=int, default=THREADS, help="intra-op threads (the weights depend on it)")
    p.add_argument("--bf16", action="store_true", help="bf16-autocast matmuls (faster; see the docstring)")
    p.add_argument("--eval-n", type=int, default=200, help="test problems per task to measure roles on")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m marlflow.models.toybuild", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", required=True, type=Path)
    add_arguments(ap)
    a = ap.parse_args(argv)
    info = build_toy(a.out, seed=a.seed, steps=a.steps, batch_size=a.batch_size, lr=a.lr, eval_n=a.eval_n,
                     solve_steps=a.solve_steps, threads=a.threads, bf16=a.bf16)  # fmt: skip
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
