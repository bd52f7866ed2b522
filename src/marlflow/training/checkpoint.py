"""Checkpoints of a training run: everything its future depends on, written whole or not at all.

`RUN/checkpoints/step-N/` holds
    adapters/          each policy's PEFT adapter folder (for people and tools; resume reads state.pt)
    state.pt           adapters, AdamW and scheduler states, the per-role gradient EMAs, intervention state
                       (marlflow.interventions.State), the Python / NumPy / torch / CUDA RNG states, step
                       and NaN streak
    metrics.parquet    the metric rows so far; samples.parquet: the sample rows so far
    outcomes.parquet   the per-problem outcome rows so far
    eval-partial.pt    only in a checkpoint taken between two chunks of the step's evaluation (a stop during it,
                       RunConfig.eval_chunk_problems): the finished chunks' episodes and seconds
                       (marlflow.training.evaluation.Partial), from which the rerun computes the evaluation's
                       rows exactly (role metrics and samples read every episode); eval-partial-outcomes.parquet:
                       those problems' outcome rows, for people and tools
    COMPLETE           written last; a folder without it is never resumed from. JSON: the step, the run
                       config's training identity and its fingerprint (marlflow.core.config), the rank count
It is written to `.step-N.tmp` and renamed into place, so a kill at any moment leaves the newest complete
checkpoint loadable; `keep_checkpoints` prunes older ones after the rename. Resume equivalence (a run killed
and resumed writes the same metrics and adapters as one that was not) rests on this module restoring every
piece of state that `save` writes; tests/test_resume.py checks it.

The trainer calls `save(trainer)` every `grpo.save_every` steps (0: at the last step only) and `restore(trainer)`
at start. On a SIGTERM or SIGUSR1 (marlflow.training.preempt) it also saves the last completed step, whatever save_every
says, unless that step's checkpoint already exists, and exits with code 75; a step abandoned during its rollout
puts the RNG states back first (`rng_state` / `set_rng_state`), so the checkpoint is the one that the step's
start would have written and the rerun redoes the step bit for bit.

Checkpoints of another config are never resumed from. When a cell of matrix.yaml changes, Snakemake reruns that
run under the new config, and resuming it from the old config's step 30 would mix two runs in one curve.
`restore` then moves `checkpoints/` aside to `checkpoints-superseded-<fingerprint>/` (kept, not deleted; remove
it to free the space), logs what differs, and training starts at step 0. Checkpoints written before the
fingerprint existed carry none and are resumed from as before.

Data-parallel runs (marlflow.training.distributed): every rank holds the same adapters and optimizer states (the same
all-reduced gradients), so rank 0 alone writes, and a checkpoint restores under any rank count: a config that
differs only in `ranks` is resumed from, not superseded. Only its sampling may tie it to the rank count: with
sampling_seeds "stream" `restore` refuses (RankCountError, `rank_change_refusal` says what to do); with "per_call"
the episodes do not depend on the rank count and the run resumes.
"""

from __future__ import annotations

import errno
import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from marlflow.core.config import config_differences, config_fingerprint, training_identity
from marlflow.models.runs import adapter_dir, base_model_id, checkpoints, set_base_model
from marlflow.store.atomic import atomic_write_json, atomic_write_parquet
from marlflow.store.schema import SAMPLE_COLUMNS, write_metrics, write_outcomes
from marlflow.training import distributed
from marlflow.training.evaluation import Partial

log = logging.getLogger("marlflow.training.checkpoint")

PARTIAL = "eval-partial.pt"  # a checkpoint's unfinished evaluation (evaluation.Partial as a dict)
PARTIAL_OUTCOMES = "eval-partial-outcomes.parquet"  # its finished problems' outcome rows (OUTCOME_COLUMNS)


class DiskFullError(RuntimeError):
    """The disk filled up while a checkpoint was written; the previous checkpoint is intact."""


def complete(out_dir: Path) -> list[Path]:
    """The run's complete checkpoint folders, oldest first (found by `marlflow.models.runs.checkpoints`)."""
    return list(checkpoints(out_dir).values())


def rng_state() -> dict:
    """The Python, NumPy, torch and CUDA (every device; None without CUDA) RNG states, as checkpoints hold them."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    """Put back RNG states from `rng_state()`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(trainer) -> Path:
    """Write `trainer.state_dict()` (and its adapters in PEFT folders) at its current step; returns the checkpoint folder. Raises DiskFullError
    (naming the checkpoint that is still intact) when the disk fills up."""
    root = trainer.out_dir / "checkpoints"
    final, tmp = root / f"step-{trainer.step}", root / f".step-{trainer.step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(trainer, tmp)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)  # a torn temp folder is never resumed from; free its space
        if err.errno != errno.ENOSPC:
            raise
        last = complete(trainer.out_dir)
        kept = f"the previous checkpoint {last[-1].name} is intact" if last else "no checkpoint was lost"
        raise DiskFullError(
            f"disk full while writing the step-{trainer.step} checkpoint under {root} ({err}); {kept}. Free disk "
            "space (or set keep_checkpoints, raise grpo.save_every) and rerun: training resumes from the newest "
            "complete checkpoint"
        ) from err
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    keep = trainer.cfg.keep_checkpoints
    if keep:
        for old in complete(trainer.out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _write(trainer, tmp: Path) -> None:
    policies = list(trainer.cfg.policies)
    tmp.mkdir(parents=True)
    trainer.model.save_pretrained(tmp / "adapters", selected_adapters=policies)
    # The base by hub id or by its folder relative to the repository root, not the absolute folder of this
    # clone: a copy of results/ elsewhere must load its own base (marlflow.models.runs.base_model_id).
    base = base_model_id(trainer.cfg, trainer.out_dir)
    for p in policies if trainer.cfg.adapter == "lora" else ():  # a full model's folder names no base
        set_base_model(adapter_dir(tmp / "adapters", p), base)
    state = trainer.state_dict()
    metric_rows, sample_rows = state.pop("metric_rows"), state.pop("sample_rows")
    outcome_rows = state.pop("outcome_rows")
    partial = state.pop("pending_eval", None)
    torch.save(state, tmp / "state.pt")
    if partial is not None:  # whole or not at all with the folder (its rename below), like every file here
        torch.save(vars(partial), tmp / PARTIAL)  # not dataclasses.asdict: the episodes stay Episodes
        write_outcomes(partial.outcome_rows(trainer.cfg, trainer.task), tmp / PARTIAL_OUTCOMES)
    write_metrics(pd.DataFrame(metric_rows), tmp / "metrics.parquet")
    atomic_write_parquet(pd.DataFrame(sample_rows, columns=SAMPLE_COLUMNS), tmp / "samples.parquet")
    write_outcomes(outcome_rows, tmp / "outcomes.parquet")
    cfg = trainer.cfg.to_dict()
    atomic_write_json(
        tmp / "COMPLETE",
        {
            "step": state["step"],
            "config_fingerprint": config_fingerprint(cfg),
            "config": training_identity(cfg),
            "ranks": trainer.cfg.ranks,
        },
    )


class RankCountError(RuntimeError):
    """A checkpoint written under another rank count, which this run's sampling cannot resume from."""


def restore(trainer) -> bool:
    """Load the newest complete checkpoint into `trainer` (`trainer.load_state_dict`: each adapter goes back to
    its own policy, and the rollout backend is given the restored adapters), if any; False when there is none.
    Data parallel: rank 0 picks the checkpoint (and moves another config's aside), every rank loads it. Raises
    RankCountError when it was written under another rank count and the run samples with stream seeds."""
    ckpt, refusal = distributed.from_main(lambda: _choose(trainer))
    if refusal:
        raise RankCountError(refusal)
    if ckpt is None:
        return False
    state = torch.load(ckpt / "state.pt", weights_only=False)
    state["metric_rows"] = pd.read_parquet(ckpt / "metrics.parquet").to_dict("records")
    state["sample_rows"] = pd.read_parquet(ckpt / "samples.parquet").to_dict("records")
    if (ckpt / "outcomes.parquet").exists():  # checkpoints written before outcomes existed have none
        state["outcome_rows"] = pd.read_parquet(ckpt / "outcomes.parquet").to_dict("records")
    else:
        log.warning(
            "%s holds no outcomes.parquet: the evaluations before it keep no per-problem outcomes", ckpt
        )
    # stopped between two chunks of the step's evaluation: the rerun goes on from the next chunk
    if (ckpt / PARTIAL).exists():
        state["pending_eval"] = Partial(**torch.load(ckpt / PARTIAL, weights_only=False))
        log.info("%s holds %d problems of its step's evaluation; evaluating the rest first", ckpt.name,
                 state["pending_eval"].done())  # fmt: skip
    trainer.load_state_dict(state)  # also publishes the restored adapters to the rollout engine
    log.info("resumed from %s", ckpt)
    return True


def _choose(trainer) -> tuple[Path | None, str | None]:
    """(the checkpoint to resume from or None, None) or (None, why it cannot be resumed from)."""
    ckpts = complete(trainer.out_dir)
    if not ckpts:
        return None, None
    refusal = rank_change_refusal(trainer.cfg, ckpts[-1])
    if refusal:
        return None, refusal
    if _supersede_if_other_config(trainer, ckpts[-1]):
        return None, None
    return ckpts[-1], None


def _without_ranks(d: dict) -> str:
    return config_fingerprint({k: v for k, v in d.items() if k != "ranks"})


def rank_change_refusal(cfg, ckpt: Path) -> str | None:
    """None, or why `cfg` cannot resume from `ckpt`: it was written under another rank count (COMPLETE's
    "ranks", 1 when absent) by an otherwise identical config, and the run samples with "stream" seeds (one RNG
    stream per rank: the episodes depend on the rank count). With "per_call" seeds a call's tokens do not depend
    on which rank samples it, so the run resumes under any rank count (docs/slurm.md, "Several GPUs per run")."""
    marker = json.loads((ckpt / "COMPLETE").read_text())
    theirs = marker.get("config") if isinstance(marker, dict) else None
    ranks = int(marker.get("ranks", 1)) if isinstance(marker, dict) else 1
    if theirs is None or ranks == cfg.ranks or _without_ranks(theirs) != _without_ranks(cfg.to_dict()):
        return None  # the same rank count, or another config (superseded, not refused)
    if getattr(cfg, "sampling_seeds", "stream") != "stream":
        return None
    return (f"checkpoint {ckpt} was written by {ranks} rank(s) and run {cfg.run_id} now has ranks {cfg.ranks}; "
            "with sampling_seeds 'stream' the episodes depend on the rank count, so it cannot be resumed from. "
            f"Set ranks back to {ranks} (matrix.yaml presets.{cfg.preset}.run.ranks), or move "
            f"{ckpt.parent} aside to train from step 0 (runs with sampling_seeds 'per_call' resume under any "
            "rank count)")  # fmt: skip


def _supersede_if_other_config(trainer, ckpt: Path) -> bool:
    """Move the run's checkpoints aside if `ckpt` was written under another training config (apart from the rank
    count: `rank_change_refusal`); True if moved."""
    marker = json.loads((ckpt / "COMPLETE").read_text())
    theirs = marker.get("config_fingerprint") if isinstance(marker, dict) else None
    mine = trainer.cfg.to_dict()
    if theirs is None or theirs == config_fingerprint(mine):
        return False
    if "config" in marker and _without_ranks(marker["config"]) == _without_ranks(mine):
        return False  # only the rank count differs: resumed from (per_call seeds; rank_change_refusal)
    root = trainer.out_dir / "checkpoints"
    dest = trainer.out_dir / f"checkpoints-superseded-{theirs[:12]}"
    n = 1
    while dest.exists():  # the same old config superseded twice (A -> B -> A -> B): keep both
        n += 1
        dest = trainer.out_dir / f"checkpoints-superseded-{theirs[:12]}-{n}"
    diff = "; ".join(config_differences(marker.get("config", {}), mine)) or "fingerprint only"
    root.rename(dest)
    log.warning(
        "%s holds checkpoints of another config (%s): not resuming from them; moved to %s (delete it to free the "
        "space) and training from step 0",
        root,
        diff,
        dest,
    )
    return True
