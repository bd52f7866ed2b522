"""Evaluate a trained run's adapters on any registered task, without touching its training outputs.

    marlflow eval --run results/runs/<run_id> [--step N] [--task T] [--n K]
    python -m marlflow.evaluate --run results/runs/<run_id> [--step N] [--task T] [--n K]

Loads the run's config.json, its base model and the adapters of checkpoint step N (default: the newest
complete checkpoint; 0 is the untrained base workflow), runs the run's workflow once per problem on the
first K problems of task T's test split (default: the run's own task and eval_size) and writes

    RUN/evals/<T>-step<N>.parquet           tidy metrics (marlflow.metrics schema, split "eval"; the
                                            `task` column is T's kind, math or code)
    RUN/evals/<T>-step<N>-samples.parquet   the first few episodes in full (marlflow.metrics.SAMPLE_COLUMNS)

The evaluation is `MultiAgentGRPOTrainer.evaluate` itself (same prompts, sampling, seeded RNG stream and
metrics as the evaluations during training), called on a trainer built for task T in a throwaway folder:
nothing under RUN except evals/ is written. Evaluating the run's own task at its last step therefore
reproduces the training's last evaluation (tests/test_cli.py checks this).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile
from pathlib import Path

import pandas as pd

from marlflow.config import ConfigError, RunConfig, TaskSpec
from marlflow.metrics import SAMPLE_COLUMNS, atomic_write_parquet, write_metrics
from marlflow.runs import RunError, find_checkpoint, load_policy_model, load_run
from marlflow.tasks import get_task

log = logging.getLogger("marlflow.evaluate")


def eval_config(cfg: RunConfig, task: str | None, n: int | None, test_file: str = "") -> RunConfig:
    """The run's config with task T's spec: same workflow, sharing, model and sampling settings.

    The run's own task keeps its dataset source and files; another task uses its defaults (or test_file)."""
    name = task or cfg.task.name
    kind = get_task(name).kind  # KeyError names the known tasks
    if name == cfg.task.name:
        spec = dataclasses.replace(cfg.task, eval_size=n or cfg.task.eval_size)
    else:
        spec = TaskSpec(name=name, test_file=test_file, eval_size=n or cfg.task.eval_size, train_size=1)
    if test_file:
        spec = dataclasses.replace(spec, test_file=test_file)
    return dataclasses.replace(cfg, task=spec, task_axis=kind)


def output_paths(run_dir: Path, task: str, step: int) -> tuple[Path, Path]:
    stem = run_dir / "evals" / f"{task}-step{step}"
    return stem.with_name(stem.name + ".parquet"), stem.with_name(stem.name + "-samples.parquet")


def evaluate_run(
    run_dir: str | Path,
    task: str | None = None,
    step: int | None = None,
    n: int | None = None,
    test_file: str = "",
    device: str | None = None,
) -> tuple[Path, pd.DataFrame]:
    """Evaluate checkpoint `step` of the run on `task`; returns (metrics path, metrics frame)."""
    run_dir = Path(run_dir)
    cfg = load_run(run_dir)
    step, ckpt = find_checkpoint(run_dir, step)
    ecfg = eval_config(cfg, task, n, test_file)

    import torch  # heavy imports after the cheap checks, so bad input fails fast

    from marlflow.train import preflight
    from marlflow.trainer import MultiAgentGRPOTrainer

    if device:
        ecfg = dataclasses.replace(ecfg, device=device)
    preflight(ecfg)
    torch.set_num_threads(ecfg.threads)
    model, tok = load_policy_model(ecfg, run_dir, ckpt)
    # A throwaway out_dir: the trainer (TRL's Trainer) creates folders under it, and the run folder must
    # keep exactly what training left there.
    with tempfile.TemporaryDirectory(prefix="marlflow-eval-") as scratch:
        trainer = MultiAgentGRPOTrainer(ecfg, model, tok, get_task(ecfg.task.name), scratch)
        trainer.step = step
        acc = trainer.evaluate_workflow(step, base=step == 0)  # step 0: routed as training's step 0 is
    metrics_path, samples_path = output_paths(run_dir, ecfg.task.name, step)
    metrics = pd.DataFrame(trainer.metric_rows)
    write_metrics(metrics, metrics_path)
    atomic_write_parquet(pd.DataFrame(trainer.sample_rows, columns=SAMPLE_COLUMNS), samples_path)
    log.info(
        "%s step %d on %s: accuracy %.3f (n=%d)", cfg.run_id, step, ecfg.task.name, acc, ecfg.task.eval_size
    )
    return metrics_path, metrics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="marlflow eval", description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="run folder, e.g. results/runs/voting-ip-toy-math-s0")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the newest; 0: the untrained base)")
    ap.add_argument("--task", help="registered task to evaluate on, e.g. toy_code (default: the run's task)")
    ap.add_argument(
        "--n", type=int, help="test problems, the first n of the split (default: the run's eval_size)"
    )
    ap.add_argument("--test-file", default="", help="local JSONL/parquet test split for the task (optional)")
    ap.add_argument("--device", choices=("cpu", "cuda", "auto"), help="override the run's device")
    args = ap.parse_args(argv)
    if args.n is not None and args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    if args.step is not None and args.step < 0:
        ap.error(f"--step must be >= 0, got {args.step}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        path, metrics = evaluate_run(args.run, args.task, args.step, args.n, args.test_file, args.device)
    except KeyError as err:  # unknown task
        print(f"marlflow eval: {err.args[0]}; pass one of them to --task", file=sys.stderr)
        return 2
    except (RunError, ConfigError) as err:
        print(f"marlflow eval: {err}", file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError) as err:
        print(f"marlflow eval: evaluating {args.run} failed: {err}", file=sys.stderr)
        return 1
    acc = metrics[(metrics.role == "all") & (metrics.metric == "accuracy")].value.iloc[0]
    se = metrics[(metrics.role == "all") & (metrics.metric == "accuracy_se")].value.iloc[0]
    print(f"accuracy {acc:.3f} ± {se:.3f} (SE); wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
