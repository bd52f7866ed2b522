"""Overhead of the gradient metrics: toy Voting step time with and without them.

    python benchmarks/bench_grad_metrics.py [--model results/models/toy] [--reps 3] [--steps 3]
                                            [--sharing sp ip] [--task math] [--parity]
                                            [--quick]   # tiny mode (benchmarks/harness.py): 1 round, 1 step, sp

Each variant builds the toy preset's Voting trainer (matrix.yaml, 1 thread) and runs one warm-up step and
`--steps` measured steps. "with" is grpo.grad_metrics_every=1 (per-slot gradients, proj_share, cos_others,
slot amplification, EMA at every step, the default); "without" is grad_metrics_every=10**6, which leaves only
one flat gradient per role (what update() computed before the metrics existed). The metrics only read
gradients, so both variants do the same rollouts and the same updates step for step; they are interleaved
(with, without, without, with, ...) so that load drifts hit both. Printed: the median step_time and
time_backward of each variant over all measured steps of all repetitions, the median paired difference of
time_backward (same repetition and step; the metrics run inside update(), which time_backward times, and
generation time is the noisiest part of a step), and that difference as a share of the median step time
without metrics; then the same for the process CPU time of a whole step (time.process_time), which other
jobs on a shared machine disturb far less than wall-clock time.

--parity replaces the toy math reward by "the final answer has odd length" (the test task of
tests/test_trainer.py): a barely trained model then still has reward variance in most GRPO groups, so nearly
every call goes through forward-backward and every slot has a gradient, the worst case for the metrics.
With the real reward such a model solves nothing, every advantage is 0 and there is nothing to measure.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import pandas as pd
from harness import interleaved, parser, setup, toy_configs

from marlflow.cli.train import build_trainer
from marlflow.core.config import RunConfig
from marlflow.tasks import register
from marlflow.tasks.toy import ToyMath

NEVER = 1_000_000  # grad_metrics_every larger than any step: the per-slot / vector metrics never run


@register("parity")
class Parity(ToyMath):
    name = "parity"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


def measure(cfg: RunConfig, steps: int) -> pd.DataFrame:
    """step_time and time_backward of steps 2..steps+1 (step 1 is the warm-up) as columns, indexed by step."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, Path(tmp))
        cpu = {}
        for step in range(1, steps + 2):
            t0 = time.process_time()
            trainer.train_step(step)
            cpu[step] = time.process_time() - t0
        m = pd.DataFrame(trainer.metric_rows)
    m = m[m.step > 1]
    out = m[m.role == "all"].pivot_table(index="step", columns="metric", values="value")
    roles = m[m.role != "all"].pivot_table(index=["step", "role"], columns="metric", values="value")
    run = (roles["live_frac"] * roles["samples"]).groupby("step").sum() / roles["samples"].groupby(
        "step"
    ).sum()
    return out[["step_time", "time_backward"]].assign(calls_run=run, cpu=pd.Series(cpu))


def paired(res: dict[str, list[pd.DataFrame]], col: str) -> float:
    """Median over (repetition, step) of with - without in column `col`."""
    return statistics.median(
        a - b for x, y in zip(res["with"], res["without"]) for a, b in zip(x[col], y[col])
    )


def variant(cfg: RunConfig, every: int) -> RunConfig:
    return dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, grad_metrics_every=every))


def _measure_into(out: list, cfg: RunConfig, steps: int) -> None:
    out.append(measure(cfg, steps))


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--task", default="math", choices=["math", "code"])
    ap.add_argument("--sharing", nargs="+", default=["sp", "ip"], choices=["sp", "ip"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--parity", action="store_true", help="reward = odd output length (see the docstring)")
    args = setup(ap.parse_args(argv))
    if args.quick:
        args.steps, args.sharing = 1, args.sharing[:1]
    if not Path(args.model, "config.json").exists():
        raise SystemExit(f"--model {args.model}: no model there; build one with `python -m marlflow models`")
    configs = toy_configs(args)
    print(
        f"model {args.model}; {args.reps} repetitions x {args.steps} steps after 1 warm-up per variant, "
        f"interleaved; reward: {'parity' if args.parity else 'task'}"
    )
    print(
        "| run | calls run | step s with | step s without | fwd+bwd s with | fwd+bwd s without | paired fwd+bwd "
        "diff s | overhead | CPU s/step without | paired CPU diff s | CPU overhead |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for sharing in args.sharing:
        run_id = f"voting-{sharing}-toy-{args.task}-s0"
        cfg = configs[run_id]
        if args.parity:
            cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, name="parity"))
        res: dict[str, list[pd.DataFrame]] = {"with": [], "without": []}
        variants = {
            n: partial(_measure_into, res[n], variant(cfg, 1 if n == "with" else NEVER), args.steps)
            for n in ("with", "without")
        }
        interleaved(variants, args.reps)  # with, without, without, with, ...: drift hits both
        on, off = pd.concat(res["with"]), pd.concat(res["without"])

        base, d = statistics.median(off["step_time"]), paired(res, "time_backward")
        cpu_base, cpu_d = statistics.median(off["cpu"]), paired(res, "cpu")
        print(
            f"| {run_id} | {on['calls_run'].mean():.2f} | {statistics.median(on['step_time']):.3f} | {base:.3f} | "
            f"{statistics.median(on['time_backward']):.3f} | {statistics.median(off['time_backward']):.3f} | "
            f"{d:+.3f} | {100 * d / base:+.1f}% | {cpu_base:.3f} | {cpu_d:+.3f} | {100 * cpu_d / cpu_base:+.1f}% |"
        )


if __name__ == "__main__":
    main()
