"""What every A/B benchmark in benchmarks/ shares: one argument parser, the set-up, the environment line that a
result in RESULTS.md carries, interleaved repeats, medians and ratios.

A benchmark script imports it as a sibling (`python benchmarks/bench_x.py` puts benchmarks/ first on sys.path):

    from harness import interleaved, parser, report, setup, toy_configs

    ap = parser(__doc__)                       # --model --matrix --reps --threads --quick (+ the script's own)
    args = setup(ap.parse_args())              # quiet transformers, torch threads; prints the environment line
    times, results = interleaved({"a": run_a, "b": run_b}, args.reps)   # A B, B A, A B, ...: drift hits both
    print(report(times, base="a"))             # median seconds of each variant and its ratio to the base

`--quick` is every benchmark's tiny mode (one repeat and, where the script says so, fewer cases): it checks that
the script still runs, and its numbers are not results. Keep results in RESULTS.md with the environment line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from marlflow.core.workflow_spec import BUILTIN
from marlflow.training.environment import source_commit

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = BUILTIN  # the shipped workflows in table order (marlflow.core.workflow_spec)


def parser(doc: str, reps: int = 3, model: str | None = "results/models/toy") -> argparse.ArgumentParser:
    """The shared arguments; `doc`'s first paragraph is the description. model=None: no --model/--matrix."""
    ap = argparse.ArgumentParser(description=doc.strip().split("\n\n")[0])
    if model is not None:
        ap.add_argument("--model", default=model, help="model folder (default: %(default)s)")
        ap.add_argument(
            "--matrix", default="matrix.yaml", help="matrix file of toy_configs (default: %(default)s)"
        )
    ap.add_argument("--reps", type=int, default=reps, help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the toy runs use 1)")
    ap.add_argument(
        "--quick", action="store_true", help="tiny mode: 1 round, fewer cases; checks that it runs"
    )
    return ap


def add_cells(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--task, --sharing, --workflows: which toy runs a step benchmark measures (`toy_cells`)."""
    ap.add_argument("--task", default="math", choices=["math", "code"])
    ap.add_argument("--sharing", default="sp", choices=["sp", "ip"])
    ap.add_argument("--workflows", nargs="+", default=list(WORKFLOWS), choices=WORKFLOWS)
    return ap


def setup(args: argparse.Namespace) -> argparse.Namespace:
    """Quiet transformers' logging and progress bars, set torch's threads (and 1 round under --quick), print
    the environment line; returns `args`."""
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.reps = 1
    if getattr(args, "model", None) is not None:
        args.model = _model_folder(args.model)
    print(environment(), flush=True)
    return args


def _model_folder(model: str) -> str:
    """`model` if it is a folder or a hub id; the shipped toy model when the default results/models/toy (toy world
    v1, which the benchmarks time) has not been copied yet (the `toy` preset copies it: the two hold the same
    weights); else exit with the fix."""
    if Path(model).is_dir() or (
        not model.startswith((".", "/", "results/", "src/")) and model.count("/") == 1
    ):
        return model
    if Path(model) == Path("results/models/toy"):
        from marlflow.models.loading import SHIPPED_TOY

        print(f"{model} not there yet (the toy preset copies it): using the shipped toy model {SHIPPED_TOY}")
        return str(SHIPPED_TOY)
    raise SystemExit(
        f"--model {model}: no such folder; pass a model folder (e.g. src/marlflow/models/toy_model)"
    )


def commit() -> str:
    """The checkout's short commit, "+dirty" when tracked files differ from it; "unknown" outside git."""
    return source_commit(ROOT, short=True) or "unknown"


def environment() -> str:
    """One line naming what a number depends on: CPU, cores, torch and its kernel level, threads, commit."""
    import torch

    from marlflow.models.toybuild import cpu_info

    return (
        f"machine: {cpu_info()['cpu_model']}, {os.cpu_count()} cores, "
        f"kernels {torch.backends.cpu.get_cpu_capability()}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); commit {commit()}"
    )


def toy_configs(args: argparse.Namespace, preset: str = "toy") -> dict:
    """run id -> RunConfig of `preset`'s runs in args.matrix, with args.model as the model."""
    from marlflow.core.config import RunConfig
    from marlflow.pipeline.matrix import run_sheet

    sheet = run_sheet(args.matrix, preset=preset)
    return {
        rid: RunConfig.from_dict({**json.loads(sheet.loc[rid, "config"]), "model": args.model})
        for rid in sheet.index
    }


def eval_rollout(cfg, trainer, seed: int, temperature: float = 0.7, problems=None) -> float:
    """One evaluation rollout of `trainer` (a marlflow trainer of RunConfig `cfg`) over `problems` (default: its
    test problems) from a fixed seed, torch's global RNG restored after; returns the accuracy."""
    import torch

    from marlflow.workflows import rollout

    problems = trainer.eval_problems if problems is None else problems
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        episodes = rollout(cfg, trainer.task, problems, trainer._ctx(temperature, seed=seed), 1)
    return sum(e.reward for e in episodes) / len(episodes)


def toy_cells(args: argparse.Namespace) -> dict:
    """run id -> RunConfig of the toy runs add_cells selects: args.task, args.sharing (single: sp), one per
    workflow in args.workflows order; under --quick the first workflow only."""
    configs = toy_configs(args)
    out = {}
    for wf in args.workflows[: 1 if args.quick else None]:
        sharing = "sp" if wf == "single" else args.sharing
        rid = next(
            r for r, c in configs.items() if (c.workflow, c.sharing, c.task_axis) == (wf, sharing, args.task)
        )
        out[rid] = configs[rid]
    return out


def interleaved(variants: dict[str, Callable[[], object]], reps: int) -> tuple[dict[str, list[float]], dict]:
    """Run each variant `reps` times, interleaved and alternating in order (A B, B A, A B, ...), so that a
    load drift or a warm cache favours none. Returns (name -> seconds of each run, name -> last result)."""
    times: dict[str, list[float]] = {n: [] for n in variants}
    results: dict = {}
    names = list(variants)
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            results[name] = variants[name]()
            times[name].append(time.perf_counter() - t)
    return times, results


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {n: statistics.median(v) for n, v in times.items()}


def report(times: dict[str, list[float]], base: str) -> str:
    """ "name median s (x ratio to base)" for every variant, one line."""
    med = medians(times)
    return ", ".join(
        f"{n} {m:.3f} s" + ("" if n == base else f" (x{m / med[base]:.2f})") for n, m in med.items()
    )
