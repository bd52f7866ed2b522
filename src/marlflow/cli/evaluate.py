"""Evaluate a trained run's adapters on any registered task, without touching its training outputs.

    marlflow eval --run results/runs/<run_id> [--step N] [--task T] [--n K] [--max-new-tokens M]
    python -m marlflow eval ...   (the same command)

Loads the run's config.json, its base model and the adapters of checkpoint step N (default: the newest
complete checkpoint; 0 is the untrained base workflow), runs the run's workflow once per problem on the
first K problems of task T's test split (default: the run's own task and eval_size) and writes

    RUN/evals/<KEY>.parquet           tidy metrics (marlflow.store.schema schema, split "eval"; the
                                      `task` column is T's kind, math or code)
    RUN/evals/<KEY>-samples.parquet   the first few episodes in full (marlflow.store.schema.SAMPLE_COLUMNS)
    RUN/evals/<KEY>-outcomes.parquet  one row per problem (marlflow.store.schema.OUTCOME_COLUMNS)
    RUN/evals/<KEY>.json              accuracy, its SE, n, the completion budget used, the share of
                                      role calls cut off at it, and any warning

KEY names every setting that changes the numbers, `<T>-step<N>-n<K>-tok<M>` (plus `-<device>` when --device
differs from the run's, and `-test-<hash>` for --test-file; `eval_key`), so evaluating again with another --n
or budget adds files instead of overwriting them. The newest evaluation of T at step N is also copied to
`RUN/evals/<T>-step<N>{.parquet,-samples.parquet,-outcomes.parquet,.json}`.

Each role call may generate at most task T's completion budget: `--max-new-tokens`, else the
`grpo.max_completion_length` that matrix.yaml gives task T (the run's preset first, at the run's scale
where it can), else the run's own. A run's own budget is sized for its own task (toy math: 24 tokens, toy
code: 40), and an answer cut off is scored wrong. When more than 5% of the calls hit the budget, the command
warns on stderr and in the JSON.

The evaluation is `marlflow.training.evaluation.evaluate`, the function training's evaluations call (same prompts,
sampling, seeded RNG stream and metrics), on the model, rollout backend and test problems alone: no trainer,
optimizer or train split is built, and nothing under RUN except evals/ is written. Evaluating the run's own
task at its last step therefore reproduces the training's last evaluation (tests/test_cli.py checks this).
Validation problems (task.val_size) are not evaluated: they exist for what selects during training.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import pandas as pd

from marlflow.core.config import ConfigError, RunConfig, TaskSpec
from marlflow.models.runs import RunError, find_checkpoint, load_policy_model, load_run, run_root
from marlflow.store.atomic import atomic_write_json, atomic_write_parquet
from marlflow.store.schema import SAMPLE_COLUMNS, write_metrics, write_outcomes
from marlflow.tasks import get_task
from marlflow.tasks.splits import eval_problems

log = logging.getLogger("marlflow.cli.evaluate")

# More than this share of role calls cut off at the completion budget gets a warning.
TRUNCATION_WARN = 0.05
# Role-"all" metrics that `marlflow eval` adds to what the training's evaluation logs.
EVAL_ONLY_METRICS = ("max_new_tokens", "truncated_share")


def matrix_file(run_dir: str | Path) -> Path | None:
    """The matrix.yaml of the repository that holds the run (ROOT/results/runs/<id>), else ./matrix.yaml."""
    root = run_root(run_dir)
    for cand in ([root / "matrix.yaml"] if root is not None else []) + [Path("matrix.yaml")]:
        if cand.is_file():
            return cand
    return None


def task_budget(cfg: RunConfig, task: str, run_dir: str | Path) -> tuple[int, str]:
    """(completion budget, where it comes from) for evaluating the run on `task`.

    The run's own task keeps the run's budget. Another task gets the `grpo.max_completion_length` that
    matrix.yaml gives it: in the run's preset if it runs that task (at the run's scale when it can), else in
    the first preset that does. Without one, the run's own budget, said so in the source."""
    own = cfg.grpo.max_completion_length
    if task == cfg.task.name:
        return own, f"run {cfg.run_id}'s own"
    path = matrix_file(run_dir)
    if path is not None:
        from marlflow.pipeline.matrix import MatrixError, load_matrix, run_sheet

        try:
            doc = load_matrix(path)
        except MatrixError:
            doc = None
        for preset in dict.fromkeys([cfg.preset, *(doc or {}).get("presets", {})]):
            try:
                sheet = run_sheet(doc, preset)
            except (MatrixError, KeyError, TypeError):
                continue  # a preset that does not expand (or no matrix) has nothing to say
            cells = [json.loads(c) for c in sheet["config"]]
            cells = [c for c in cells if c["task"]["name"] == task]
            cells.sort(key=lambda c: c["scale"] != cfg.scale)
            if cells:
                return int(cells[0]["grpo"]["max_completion_length"]), f"{path}: presets.{preset}"
    return own, f"run {cfg.run_id}'s own (no preset in matrix.yaml runs {task})"


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


def eval_key(task: str, step: int, n: int, budget: int, device: str = "", test_file: str = "") -> str:
    """The name of an evaluation's files: every setting that changes its numbers (task, step, number of
    problems, completion budget; the device when it is not the run's, and the test file's path)."""
    import hashlib

    key = f"{task}-step{step}-n{n}-tok{budget}" + (f"-{device}" if device else "")
    if test_file:
        key += "-test-" + hashlib.sha256(str(Path(test_file).resolve()).encode()).hexdigest()[:8]
    return key


def output_paths(run_dir: Path, task: str, step: int, key: str = "") -> tuple[Path, Path, Path]:
    """The metrics, samples and outcomes files of an evaluation of `task` at `step`: under `key` (`eval_key`),
    else the newest evaluation's `<task>-step<step>` names."""
    stem = run_dir / "evals" / (key or f"{task}-step{step}")
    return tuple(
        stem.with_name(stem.name + end) for end in (".parquet", "-samples.parquet", "-outcomes.parquet")
    )


def _copy_as_newest(keyed: tuple[Path, ...], newest: tuple[Path, ...]) -> None:
    """Copy an evaluation's keyed files (and its .json) to the `<task>-step<N>` names, each atomically."""
    import os
    import shutil

    for src, dst in zip((*keyed, keyed[0].with_suffix(".json")), (*newest, newest[0].with_suffix(".json"))):
        tmp = dst.with_name(f".{dst.name}.tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)


def _evaluate_checkpoint(ecfg: RunConfig, run_dir: Path, ckpt: Path | None, step: int):
    """marlflow.training.evaluation.evaluate of checkpoint `ckpt` (None: the base) on ecfg's task: the model, the rollout
    backend and the test problems, nothing else (no trainer, optimizer or train split)."""
    import torch  # heavy imports after the cheap checks, so bad input fails fast

    from marlflow.cli.train import preflight
    from marlflow.generation.fastgen import use_gqa_sdpa
    from marlflow.generation.hf import ChatEncoder, make_backend
    from marlflow.training.evaluation import evaluate

    preflight(ecfg)
    torch.set_num_threads(ecfg.threads)
    task = get_task(ecfg.task.name)
    problems = eval_problems(task, ecfg.task)
    if not problems:
        raise ValueError(
            f"task {ecfg.task.name!r} has an empty test split; pass --test-file or another --task"
        )
    model, tok = load_policy_model(ecfg, run_dir, ckpt)
    use_gqa_sdpa(model, ecfg.fastgen)  # as the trainer does (the same forward, K/V heads read in place)
    backend = make_backend(ecfg.backend, model, tok, ecfg.policies, ecfg)
    try:
        if hasattr(task, "warm_up"):  # code tasks: start (and check) the sandbox
            task.warm_up()
        encoder = ChatEncoder(tok, ecfg.grpo.max_prompt_length)
        # step 0: every role routed to the first policy, as training's step-0 evaluation is
        return evaluate(ecfg, task, backend, encoder, problems, step, base=step == 0)
    finally:
        backend.close()


def evaluate_run(
    run_dir: str | Path,
    task: str | None = None,
    step: int | None = None,
    n: int | None = None,
    test_file: str = "",
    device: str | None = None,
    max_new_tokens: int | None = None,
) -> tuple[Path, pd.DataFrame]:
    """Evaluate checkpoint `step` of the run on `task`; returns (metrics path, metrics frame).

    max_new_tokens: the completion budget per role call (default: `task_budget`). The frame's role-"all"
    rows add `max_new_tokens` and `truncated_share` (role calls that hit it); RUN/evals/<KEY>.json
    has both and a `warnings` list (non-empty above TRUNCATION_WARN)."""
    run_dir = Path(run_dir)
    cfg = load_run(run_dir)
    step, ckpt = find_checkpoint(run_dir, step)
    ecfg = eval_config(cfg, task, n, test_file)
    budget, source = (
        (max_new_tokens, "--max-new-tokens") if max_new_tokens else task_budget(cfg, ecfg.task.name, run_dir)
    )
    ecfg = dataclasses.replace(ecfg, grpo=dataclasses.replace(ecfg.grpo, max_completion_length=budget))

    if device:
        ecfg = dataclasses.replace(ecfg, device=device)
    ev = _evaluate_checkpoint(ecfg, run_dir, ckpt, step)
    acc = ev.accuracy
    key = eval_key(ecfg.task.name, step, ecfg.task.eval_size, budget,
                   device if device and device != cfg.device else "", test_file)  # fmt: skip
    metrics_path, samples_path, outcomes_path = output_paths(run_dir, ecfg.task.name, step, key)
    metrics = pd.DataFrame(ev.metric_rows)
    roles = metrics[(metrics.role != "all") & metrics.metric.isin(["truncated_share", "calls"])]
    per_role = roles.pivot_table(index="role", columns="metric", values="value")
    truncated = float((per_role.truncated_share * per_role.calls).sum() / per_role.calls.sum())
    all_row = metrics[(metrics.role == "all")].iloc[0].to_dict()
    extra = [{**all_row, "metric": "max_new_tokens", "value": float(budget)},
             {**all_row, "metric": "truncated_share", "value": truncated}]  # fmt: skip
    metrics = pd.concat([metrics, pd.DataFrame(extra)], ignore_index=True)
    write_metrics(metrics, metrics_path)
    atomic_write_parquet(pd.DataFrame(ev.sample_rows, columns=SAMPLE_COLUMNS), samples_path)
    write_outcomes(ev.outcome_rows, outcomes_path)
    warnings = []
    if truncated > TRUNCATION_WARN:
        warnings.append(
            f"{truncated:.0%} of the role calls hit the completion budget of {budget} tokens ({source}) and were "
            f"cut off, so their answers are likely scored wrong; rerun with a larger --max-new-tokens"
        )
    summary = {
        "run_id": cfg.run_id, "task": ecfg.task.name, "step": step, "accuracy": acc,
        "accuracy_se": float(metrics[(metrics.role == "all") & (metrics.metric == "accuracy_se")].value.iloc[0]),
        "n_eval": ecfg.task.eval_size, "max_new_tokens": budget, "max_new_tokens_from": source,
        "truncated_share": truncated, "warnings": warnings, "metrics": str(metrics_path),
    }  # fmt: skip
    atomic_write_json(metrics_path.with_suffix(".json"), summary)
    _copy_as_newest((metrics_path, samples_path, outcomes_path), output_paths(run_dir, ecfg.task.name, step))
    log.info(
        "%s step %d on %s: accuracy %.3f (n=%d), max_new_tokens %d (%s), %.1f%% of calls cut off",
        cfg.run_id, step, ecfg.task.name, acc, ecfg.task.eval_size, budget, source, 100 * truncated,
    )  # fmt: skip
    for w in warnings:
        log.warning(w)
    return metrics_path, metrics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="marlflow eval", description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="run folder, e.g. results/runs/voting-ip-toy-math-s0")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the newest; 0: the untrained base)")
    ap.add_argument("--task", help="registered task to evaluate on, e.g. toy_code (default: the run's task)")
    ap.add_argument(
        "--n", type=int, help="test problems, the first n of the split (default: the run's eval_size)"
    )
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        help="completion budget per role call (default: the budget matrix.yaml gives the task; the run's own "
        "for its own task)",
    )
    ap.add_argument("--test-file", default="", help="local JSONL/parquet test split for the task (optional)")
    ap.add_argument("--device", choices=("cpu", "cuda", "auto"), help="override the run's device")
    args = ap.parse_args(argv)
    if args.n is not None and args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    if args.step is not None and args.step < 0:
        ap.error(f"--step must be >= 0, got {args.step}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        path, metrics = evaluate_run(
            args.run, args.task, args.step, args.n, args.test_file, args.device, args.max_new_tokens
        )
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
    summary = json.loads(path.with_suffix(".json").read_text())
    for w in summary["warnings"]:
        print(f"marlflow eval: warning: {w}", file=sys.stderr)
    newest = output_paths(path.parent.parent, summary["task"], summary["step"])[0]
    print(
        f"accuracy {acc:.3f} ± {se:.3f} (SE), max_new_tokens {summary['max_new_tokens']}, "
        f"{summary['truncated_share']:.1%} of role calls cut off; wrote {path} (the newest evaluation of "
        f"{summary['task']} at step {summary['step']} is also {newest})"
        + (" (WARNING: answers cut off, see above)" if summary["warnings"] else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
