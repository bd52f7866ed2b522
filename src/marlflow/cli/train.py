"""Train one cell of the matrix: `marlflow train --config CONFIG.json --out RUN_DIR [--log LOG]`.

Reads a `RunConfig` (written by the Snakemake rule `run_config`), loads the base model once, puts one
LoRA adapter per policy on it (SP: "shared"; IP: one per role type), and runs
`MultiAgentGRPOTrainer.fit()`. A rerun of a killed job resumes from the newest complete checkpoint in
RUN_DIR/checkpoints. Outputs, each written atomically, DONE last:

    RUN_DIR/metrics.parquet   tidy metrics (marlflow.store.schema schema)
    RUN_DIR/samples.parquet   a few full eval episodes per evaluation (every role's prompt and output)
    RUN_DIR/outcomes.parquet  every evaluation's per-problem outcomes, test and validation, step 0 included
                              (marlflow.store.schema.OUTCOME_COLUMNS)
    RUN_DIR/checkpoints/step-N/adapters/<policy>/   LoRA adapters (PEFT format) + optimizer/RNG state
    RUN_DIR/final/<policy>/   the last step's adapters for PeftModel.from_pretrained + model card (marlflow.training.final)
    RUN_DIR/DONE              JSON with the final step and accuracy

and, at every start of training (fresh or resumed), one line appended to RUN_DIR/environment.jsonl: the host,
CPU, torch, GPU, threads, ranks and commit it trains with (marlflow.training.environment; provenance only, not an output).

--log LOG sends the process's stdout and stderr to LOG (the train rule's log); a previous attempt's LOG (a
killed or preempted job that is now resumed) is first renamed to LOG.attempt-1, -2, ... so every attempt
keeps its own log.

One trainer per run folder: a second `marlflow train` of a folder whose trainer is alive exits 3 at once,
naming the holder (marlflow.store.lock; the lock goes with the process, however it ends).

Exit codes: 0 done; 1 the run failed (the message says why); 2 an invalid run config; 3 another trainer holds
the run folder; 75 stopped by a SIGTERM
or SIGUSR1 after checkpointing its last completed step: rerun it to resume, nothing is lost (Snakemake's
`retries` does). The first SIGTERM / SIGUSR1 abandons the current step if its update has not started, else
finishes it (and its evaluation, when due), then checkpoints and exits 75; a second one exits at once with
128 + signal (143 / 138), leaving the newest complete checkpoint; SIGINT stops at once (marlflow.training.preempt).
SLURM's `--signal=USR1@900` (profiles/slurm) sends SIGUSR1 15 minutes before the time limit.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import sys
from pathlib import Path

import pandas as pd
import torch

from marlflow.core.config import ConfigError, RunConfig, check_task_kind
from marlflow.store.atomic import atomic_write_json, atomic_write_parquet
from marlflow.store.lock import FolderLocked, folder_lock
from marlflow.store.schema import write_metrics
from marlflow.tasks import get_task
from marlflow.tasks.splits import run_splits
from marlflow.training import distributed, preempt, trackers
from marlflow.training.final import write_final

# Rank 0's report to the launcher that an N-rank run stopped on a signal, checkpointed (distributed.launch).
PREEMPTED_FILE = ".preempted"
EXIT_LOCKED = 3  # another live trainer holds the run folder (marlflow.store.lock)


def preflight(cfg: RunConfig) -> None:
    """Fail before any work when the run cannot work here: no GPU for a GPU run, a missing extra."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"run {cfg.run_id} asks for device 'cuda' (preset {cfg.preset!r}) but torch sees no CUDA GPU; run it "
            "on a GPU node (snakemake --profile profiles/slurm) or pick a CPU preset such as toy or smol"
        )
    if cfg.backend == "vllm":
        from marlflow.generation.vllm import require_vllm

        require_vllm(cfg.device)
    trackers.require(cfg.report_to)  # a tracker's library is missing: the message names the extra


class LoadedTask:
    """A task whose train and test splits are loaded up front: a broken dataset fails in seconds, before
    the model loads and before the run folder exists. Everything else is the task's own."""

    def __init__(self, task, spec):
        self._task, self._spec = task, spec
        self._splits = {split: task.load(split, spec) for split in ("train", "test")}
        run_splits(self, spec)  # a validation set that cannot be held out (task.val_size) fails here too

    def load(self, split: str, spec=None):
        # Another spec (marlflow.tasks.splits asks for train_size + val_size problems) loads afresh.
        return self._splits[split] if spec is None or spec == self._spec else self._task.load(split, spec)

    def __getattr__(self, name):
        return getattr(self._task, name)


def build_trainer(cfg: RunConfig, out_dir: Path, task=None):
    from marlflow.models.loading import attach_adapters, load_model_and_tokenizer
    from marlflow.training.trainer import MultiAgentGRPOTrainer

    preflight(cfg)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    base, tok = load_model_and_tokenizer(cfg.model, device=cfg.device)
    task = task if task is not None else get_task(cfg.task.name)
    return MultiAgentGRPOTrainer(cfg, attach_adapters(cfg, base), tok, task, out_dir)


def _remove_empty_dirs(top: Path) -> None:
    """Remove `top` and folders under it that hold no file; anything with a file in it stays."""
    for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        top.rmdir()


def run(cfg: RunConfig, out_dir: Path, task=None) -> pd.DataFrame:
    """Train `cfg` into `out_dir` and write its outputs (the module docstring); returns the metrics table. Data
    parallel: every rank trains, rank 0 alone writes (every rank holds the same rows)."""
    main = distributed.is_main()
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        trainer = build_trainer(cfg, out_dir, task)
        if main:  # only once the run can start: a failed start leaves a finished run's outputs as they were
            (out_dir / "DONE").unlink(missing_ok=True)
        metrics = trainer.fit()
    except BaseException:
        if created and main:  # a run that failed before writing anything leaves no empty folder behind
            _remove_empty_dirs(out_dir)
        raise
    if not main:
        distributed.barrier()  # no rank reports the run done before rank 0 has written its files
        return metrics
    write_metrics(metrics, out_dir / "metrics.parquet")
    atomic_write_parquet(trainer.samples_frame(), out_dir / "samples.parquet")
    atomic_write_parquet(trainer.outcomes_frame(), out_dir / "outcomes.parquet")
    write_final(out_dir, cfg, metrics)
    acc = metrics[(metrics.split == "eval") & (metrics.role == "all") & (metrics.metric == "accuracy")]
    atomic_write_json(out_dir / "DONE", {"run_id": cfg.run_id, "steps": trainer.step,
                                         "final_accuracy": float(acc.value.iloc[-1])})  # fmt: skip
    distributed.barrier()
    return metrics


def log_to(path: Path) -> Path | None:
    """Redirect this process's stdout and stderr (file descriptors 1 and 2) to `path`.

    A non-empty `path` left by an earlier attempt is first renamed to `path.attempt-N` (N = 1, 2, ...: the
    first free one), so a resumed job never overwrites the log of the attempt that was killed. Returns the
    renamed log, or None."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = None
    if path.exists() and path.stat().st_size > 0:
        n = 1
        while path.with_name(f"{path.name}.attempt-{n}").exists():
            n += 1
        kept = path.with_name(f"{path.name}.attempt-{n}")
        path.rename(kept)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if kept is not None:
        print(f"marlflow train: the previous attempt's log is {kept}", file=sys.stderr, flush=True)
    return kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="marlflow train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="run config JSON (results/runs/<run_id>/config.json)")
    ap.add_argument("--out", required=True, help="run folder for metrics, samples, checkpoints, DONE")
    ap.add_argument(
        "--log",
        type=Path,
        help="write stdout and stderr to this file; an earlier attempt's is kept as LOG.attempt-N",
    )
    args = ap.parse_args(argv)
    if args.log is not None:
        log_to(args.log)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # scancel, preemption, Snakemake and SLURM's --signal (SIGUSR1 before the time limit): stop at the next
    # safe point with a checkpoint (marlflow.training.preempt); every exit goes through Python, so cleanup (scratch
    # adapters, trackers) runs. Checkpoints are renamed into place whole: stopping anywhere leaves the newest one.
    preempt.install()
    try:
        cfg = RunConfig.load(args.config)
    except ConfigError as err:  # every problem with the file, its JSON, a key or a value
        print(f"marlflow train: invalid run config {args.config}: {err}", file=sys.stderr)
        return 2
    # ranks > 1: this process starts the ranks (torchrun here, srun inside a SLURM job) and waits for them; they
    # inherit the --log redirection above. Its exit code is the run's: 75 when rank 0 reported a stop after its
    # checkpoint, which neither torchrun nor srun passes on (distributed.launch: signals, codes).
    launch = distributed.launch_argv(cfg.ranks, ["--config", args.config, "--out", args.out], os.environ,
                                     cfg.device, cfg.threads)  # fmt: skip
    # One trainer per run folder (marlflow.store.lock): the launcher of N ranks holds it for all of them.
    try:
        if launch is not None:
            with folder_lock(args.out, "marlflow train (launcher)"):
                print(f"marlflow train: run {cfg.run_id}: starting {cfg.ranks} ranks: {' '.join(launch)}",
                      flush=True)  # fmt: skip
                code = distributed.launch(launch, os.environ, Path(args.out) / PREEMPTED_FILE)
            print(f"marlflow train: run {cfg.run_id}: {cfg.ranks} ranks ended, exit code {code}", flush=True)
            return code
        env = distributed.init(cfg.device)
        try:
            if env.world > 1:  # a rank: its launcher holds the folder's lock
                return _train(cfg, args, env)
            with folder_lock(args.out, "marlflow train"):
                return _train(cfg, args, env)
        finally:
            distributed.close()
    except FolderLocked as err:
        print(f"marlflow train: run {cfg.run_id}: {err}", file=sys.stderr)
        return EXIT_LOCKED


def _rank_logging(env: distributed.Env) -> None:
    """Data parallel: rank 0 logs as a single process does; the others log warnings and errors only, each line
    naming its rank (they share the run's log)."""
    if env.world > 1:
        print(
            f"marlflow train: rank {env.rank} of {env.world} ({env.source}) joined",
            file=sys.stderr,
            flush=True,
        )
    if env.rank > 0:
        logging.basicConfig(level=logging.WARNING, force=True,
                            format=f"%(asctime)s %(levelname)s rank {env.rank} %(name)s: %(message)s")  # fmt: skip


def _train(cfg: RunConfig, args, env: distributed.Env) -> int:
    """The run of one process (one rank of a data-parallel run): exit code as `main`'s."""
    _rank_logging(env)
    trackers.prepare(cfg, Path(args.out))  # before TRL is imported: it imports trackio
    try:
        task = get_task(cfg.task.name)  # an unknown task fails here, before the model is loaded
        check_task_kind(cfg, task.kind)  # so does a task whose kind is not the config's task_axis
    except KeyError as err:
        print(f"marlflow train: invalid run config {args.config}: {err.args[0]}; fix the task's name in "
              "matrix.yaml (presets.<preset>.tasks)", file=sys.stderr)  # fmt: skip
        return 2
    except ConfigError as err:
        print(f"marlflow train: invalid run config {args.config}: {err}", file=sys.stderr)
        return 2
    try:
        task = LoadedTask(task, cfg.task)
    except (OSError, ValueError) as err:  # DataError is a ValueError; it names the file, line and field
        print(f"marlflow train: run {cfg.run_id}: dataset of task {cfg.task.name!r} (task.* in "
              f"{args.config}): {err}", file=sys.stderr)  # fmt: skip
        return 1
    try:
        run(cfg, Path(args.out), task)
    except preempt.Preempted:  # checkpointed and logged by the trainer
        distributed.report_preempted()  # N ranks: rank 0 tells the launcher, so that the run exits 75 too
        return preempt.EXIT_PREEMPTED
    except (OSError, ValueError, RuntimeError) as err:
        hint = ""
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            hint = "; the disk is full: free space and rerun, training resumes from the newest complete checkpoint"
        print(f"marlflow train: run {cfg.run_id} failed: {err}{hint}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
