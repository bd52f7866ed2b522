"""Reading a finished (or half-finished) run folder: its config, checkpoints, adapters and base model.

Shared by `marlflow eval`, `marlflow chat` and the `final/` writer, so that all three find the same
checkpoint, resolve the same base model and load adapters the same way. A run folder is what
`python -m marlflow train` writes (results/runs/<run_id>/):

    config.json                                      the RunConfig
    checkpoints/step-N/COMPLETE                      marker written last: only such checkpoints are used
    checkpoints/step-N/adapters/<policy>/            PEFT adapter folders (SP: shared; IP: one per role type)

    from marlflow.models.runs import load_run, find_checkpoint, load_policy_model
    cfg = load_run("results/runs/voting-ip-toy-math-s0")
    step, ckpt = find_checkpoint(run_dir)          # newest complete checkpoint
    model, tok = load_policy_model(cfg, run_dir, ckpt)
"""

from __future__ import annotations

from pathlib import Path

from marlflow.core.config import ConfigError, RunConfig


class RunError(ValueError):
    """A run folder that cannot be used as asked; the message names what is missing and how to fix it."""


def load_run(run_dir: str | Path) -> RunConfig:
    """The run's RunConfig from RUN/config.json, with errors that name the file and the fix."""
    run_dir = Path(run_dir)
    path = run_dir / "config.json"
    if not run_dir.is_dir():
        raise RunError(f"run folder {run_dir} does not exist; pass --run results/runs/<run_id>")
    if not path.is_file():
        raise RunError(
            f"{path} not found; {run_dir} is not a run folder (Snakemake writes config.json into "
            "results/runs/<run_id>/ before training)"
        )
    try:
        return RunConfig.load(path)
    except (ConfigError, ValueError, KeyError, TypeError) as err:
        raise RunError(f"{path} is not a valid run config: {err}") from err


def checkpoints(run_dir: str | Path) -> dict[int, Path]:
    """{step: folder} of the complete checkpoints (COMPLETE marker present), oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = {
        int(p.name[5:]): p for p in root.glob("step-*") if p.name[5:].isdigit() and (p / "COMPLETE").exists()
    }
    return dict(sorted(found.items()))


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> tuple[int, Path | None]:
    """(step, checkpoint folder) for `step`, or the newest complete one when step is None.

    Step 0 is the untrained base workflow: zero-initialised adapters (LoRA B = 0), so no folder (None)."""
    if step == 0:
        return 0, None
    ckpts = checkpoints(run_dir)
    if not ckpts:
        raise RunError(
            f"{run_dir} has no complete checkpoint (checkpoints/step-N/COMPLETE); train it first "
            f"(snakemake {Path(run_dir) / 'DONE'}), or use --step 0 for the untrained base workflow"
        )
    if step is None:
        step = max(ckpts)
    if step not in ckpts:
        raise RunError(
            f"{run_dir} has no complete checkpoint for step {step}; available steps: "
            f"{', '.join(map(str, ckpts))} (and 0, the base workflow)"
        )
    return step, ckpts[step]


# The weights file of a policy's folder under adapter full (transformers' save_pretrained, one shard: the
# models full fine-tuning runs on here are small; a sharded save would write an index next to it).
FULL_WEIGHTS = "model.safetensors"


def adapter_dir(ckpt: Path, policy: str) -> Path:
    """The folder of one policy in a checkpoint (or in a final/ folder): its PEFT adapter, or with adapter full
    its whole model (a transformers folder)."""
    base = ckpt / "adapters" if (ckpt / "adapters").is_dir() else ckpt
    for d in (base / policy, base):  # PEFT saves a non-default adapter in a subfolder named after it
        if (d / "adapter_config.json").is_file() or (d / FULL_WEIGHTS).is_file():
            return d
    raise RunError(f"{base} holds no adapter for policy {policy!r} (no adapter_config.json, no {FULL_WEIGHTS}); "
                   "is it complete?")  # fmt: skip


def resolve_model(cfg: RunConfig, run_dir: str | Path) -> str:
    """The run's base model as loadable from here.

    Run configs name local models relative to the repository root (results/models/toy); when the command
    runs elsewhere, the path is taken relative to the root above results/runs/<run_id>."""
    from marlflow.models.loading import HUB_ID

    model = Path(cfg.model).expanduser()
    if model.is_absolute() or model.exists():
        return str(model)
    root = run_root(run_dir)
    if root is not None and (root / model).exists():
        return str(root / model)
    if HUB_ID.match(cfg.model) and not cfg.model.startswith("."):
        return cfg.model
    where = [str(Path.cwd())] + ([str(root)] if root is not None and root != Path.cwd().resolve() else [])
    raise RunError(
        f"the run's base model {cfg.model!r} was not found (relative to {' or to '.join(where)}); run from "
        "the repository root, or rebuild it with snakemake (the `models` rule)"
    )


def run_root(run_dir: str | Path) -> Path | None:
    """The repository root that holds ROOT/results/runs/<run_id>, or None for a shallower folder."""
    parents = Path(run_dir).resolve().parents
    return parents[2] if len(parents) > 2 else None


def base_model_id(cfg: RunConfig, run_dir: str | Path) -> str:
    """What an exported adapter's `base_model_name_or_path` says (marlflow.training.final): a hub id (also
    behind a pointer folder, whose READY names the hub id), else the absolute path of the base model's folder
    as resolved now, at export, so that `AutoPeftModelForCausalLM.from_pretrained(<adapter folder>)` loads
    it from any working directory. (A path relative to the repository root, results/models/toy, loaded only
    from that root.) marlflow's own commands (eval, chat) do not read it: they resolve the base from the run's
    config.json and the root that holds the run (`resolve_model`), so a copy of results/ elsewhere still works."""
    from marlflow.models.loading import resolve_model_source

    name, hub = resolve_model_source(resolve_model(cfg, run_dir))
    return name if hub else str(Path(name).resolve())


def is_hub_id(base: str) -> bool:
    """Whether `base` (what base_model_id returns) is a hub id rather than a local folder."""
    from marlflow.models.loading import HUB_ID

    return not Path(base).is_absolute() and bool(HUB_ID.match(base)) and not Path(base).exists()


def set_base_model(adapter_folder: Path, base: str) -> None:
    """Rewrite a saved PEFT adapter's `base_model_name_or_path` to `base` (atomically)."""
    import json

    from marlflow.store.atomic import atomic_write_text

    path = adapter_folder / "adapter_config.json"
    conf = json.loads(path.read_text())
    conf["base_model_name_or_path"] = base
    atomic_write_text(path, json.dumps(conf, indent=2, sort_keys=True) + "\n")


def load_policy_model(cfg: RunConfig, run_dir: str | Path, ckpt: Path | None, device: str | None = None):
    """The base model with the run's policies, as the trainer builds it, holding the weights of `ckpt`.

    The policies are attached exactly as in training (`marlflow.models.loading.attach_adapters`: LoRA adapters,
    or whole models with adapter full), so that the model has the structure the trainer expects; then each
    policy's saved weights are loaded into it. ckpt None keeps the fresh policies, i.e. the base model."""
    from marlflow.models.loading import attach_adapters, load_model_and_tokenizer
    from marlflow.models.policies import load_policy_state, policy_state

    base, tok = load_model_and_tokenizer(resolve_model(cfg, run_dir), device=device or cfg.device)
    model = attach_adapters(cfg, base)
    if ckpt is not None:
        where = str(next(model.parameters()).device)
        for policy in cfg.policies:
            folder = adapter_dir(ckpt, policy)
            saved = _saved_weights(cfg, folder, where)
            expected = set(policy_state(model, policy))
            if cfg.adapter == "full" and model.config.tie_word_embeddings and "lm_head.weight" not in saved:
                # a tied head is saved once, as the embedding (save_pretrained drops the duplicate)
                saved["lm_head.weight"] = saved.get("model.embed_tokens.weight")
            if set(saved) != expected or any(v is None for v in saved.values()):
                odd = sorted(set(saved) ^ expected) or sorted(k for k, v in saved.items() if v is None)
                raise RunError(
                    f"the {'model' if cfg.adapter == 'full' else 'adapter'} in {folder} does not fit the run's "
                    f"model ({len(odd)} tensors differ, e.g. {odd[0]}); was config.json (adapter, lora_r, "
                    "lora_targets, model) edited after training?"
                )
            load_policy_state(model, saved, policy)
    model.eval()
    return model, tok


def _saved_weights(cfg: RunConfig, folder: Path, device: str) -> dict:
    """One policy's saved weights by name: its PEFT adapter, or (adapter full) its model's safetensors."""
    if cfg.adapter == "full":
        from safetensors.torch import load_file

        return load_file(str(folder / FULL_WEIGHTS), device=device)
    from peft.utils import load_peft_weights

    return load_peft_weights(str(folder), device=device)
