"""Data-parallel step time on this machine (issue 27): one run at 1 rank x 2 threads vs 2 ranks x 1 thread.

    python benchmarks/bench_dp.py --workflows voting       # toy preset, Voting SP math, 3 rounds x 4 steps
    python benchmarks/bench_dp.py --preset smol --model results/models/smol --workflows voting --steps 3
    python benchmarks/bench_dp.py --quick                  # 1 round, 2 steps: checks that it runs

Each round starts the two variants as fresh processes, interleaved and alternating in order (harness.interleaved):
"1x2" is one process with torch at 2 threads; "2x1" is `torchrun --standalone --nproc-per-node 2` with 1 thread
per rank (gloo). A step is what a data-parallel step of the trainer is made of today: the rank's share of the
step's problems (marlflow.distributed.shard) rolled out with the run's backend, then `trainer.update` on its
calls, whose gradients are summed over the ranks (marlflow.update.reduce_policy_grad). Per step it records, on
rank 0: generate seconds, the wait for the slower rank after the rollout (load imbalance), the update's seconds
and, inside them, the collectives' seconds (the counts' gather and the gradient all-reduce, including any wait there
for the slower rank's backward: an upper bound on the communication share). The run is the first of --workflows
(default single) with --sharing and --task. The first step of each process is a warm-up and not counted. Train metrics, evaluation and checkpoints are
not part of the step here (the trainer does not split them over ranks yet).

Run it only on an otherwise idle machine: the two variants compete for the same 2 cores with anything else.
Results go to benchmarks/RESULTS.md with the environment line this prints.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from harness import ROOT, add_cells, interleaved, parser, setup, toy_configs


def worker(cfg_path: str, steps: int, out: str) -> None:
    """One process of a variant (a rank under torchrun): the steps described above; rank 0 writes `out`."""
    import torch

    from marlflow import distributed as D
    from marlflow import rollout as ro
    from marlflow import update as upd
    from marlflow.config import RunConfig
    from marlflow.train import build_trainer

    cfg = RunConfig.load(cfg_path)
    env = D.init("cpu")
    comm = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                comm[0] += time.perf_counter() - t

        return wrapper

    upd.reduce_policy_grad = timed(upd.reduce_policy_grad)  # the trainer calls both through their modules
    D.gather = timed(D.gather)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, Path(tmp) / f"rank{env.rank}")
        rec = []
        for step in range(1, steps + 1):
            comm[0] = 0.0
            t0 = time.perf_counter()
            timer: dict = defaultdict(float)
            ctx = trainer._ctx(cfg.grpo.temperature, timer, seed=ro.rollout_seed(cfg.seed, step))
            problems = D.shard(trainer.problems_for(step), env.rank, env.world)
            batch = ro.flatten(cfg, ro.train_episodes(cfg, trainer.task, problems, ctx))
            t1 = time.perf_counter()
            D.barrier()  # the faster rank waits here for the slower one's rollout
            t2 = time.perf_counter()
            trainer.update(batch.calls, batch.advantages, metrics=True)
            D.barrier()
            t3 = time.perf_counter()
            rec.append({"step": t3 - t0, "generate": timer["generate"], "rollout": t1 - t0, "wait": t2 - t1,
                        "update": t3 - t2, "comm": comm[0], "calls": len(batch.calls)})  # fmt: skip
    if D.is_main():
        Path(out).write_text(
            json.dumps({"world": env.world, "threads": torch.get_num_threads(), "steps": rec})
        )
    D.close()


def launch(cfg, ranks: int, threads: int, steps: int, tmp: Path) -> dict:
    """Start one variant as fresh processes; rank 0's record."""
    from marlflow import distributed as D

    path, out = tmp / f"config-{ranks}x{threads}.json", tmp / f"out-{ranks}x{threads}.json"
    path.write_text(json.dumps({**cfg.to_dict(), "threads": threads}))
    argv = [str(Path(__file__).resolve()), "--worker", str(path), "--steps", str(steps), "--out", str(out)]
    env = {**D.launch_env(os.environ), "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    if ranks == 1:
        cmd = [sys.executable, *argv]
    else:
        cmd = [*D.launch_argv(ranks, [], env)[:3], *argv]  # the trainer's own torchrun command, this script
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(out.read_text())


def summary(name: str, runs: list[dict]) -> str:
    steps = [s for r in runs for s in r["steps"][1:]]  # each process's first step is its warm-up
    med = {k: statistics.median(s[k] for s in steps) for k in ("step", "generate", "wait", "update", "comm")}
    lo, hi = min(s["step"] for s in steps), max(s["step"] for s in steps)
    return (f"{name}: step {med['step']:.2f} s median ({lo:.2f}-{hi:.2f} over {len(steps)} steps): generate "
            f"{med['generate']:.2f}, wait for the slower rank {med['wait']:.2f}, update {med['update']:.2f} of which "
            f"collectives {med['comm']:.3f} ({med['comm'] / med['step']:.1%} of the step)")  # fmt: skip


def main(argv=None) -> int:
    if argv is None and "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        steps = int(sys.argv[sys.argv.index("--steps") + 1])
        worker(sys.argv[i + 1], steps, sys.argv[sys.argv.index("--out") + 1])
        return 0
    ap = add_cells(parser(__doc__))
    ap.add_argument("--preset", default="toy", help="matrix preset whose run is timed (toy, smol)")
    ap.add_argument("--steps", type=int, default=4, help="steps per process, the first a warm-up (default 4)")
    args = setup(ap.parse_args(argv))
    steps = 2 if args.quick else args.steps
    configs = toy_configs(args, args.preset)
    wf = args.workflows[0]
    sharing = "sp" if wf == "single" else args.sharing
    rid, cfg = next(
        (r, c) for r, c in configs.items() if (c.workflow, c.sharing, c.task_axis) == (wf, sharing, args.task)
    )
    print(f"run {rid}: {cfg.grpo.problems_per_step} problems x {cfg.grpo.group_size} rollouts per step, {steps} "
          f"steps per process, {args.reps} interleaved round(s)", flush=True)  # fmt: skip
    runs: dict[str, list[dict]] = {"1x2": [], "2x1": []}
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"1x2": lambda: runs["1x2"].append(launch(cfg, 1, 2, steps, Path(tmp))),
                    "2x1": lambda: runs["2x1"].append(launch(cfg, 2, 1, steps, Path(tmp)))}  # fmt: skip
        interleaved(variants, args.reps)
    for name in runs:
        print(summary(f"{name[0]} rank(s) x {name[2]} thread(s)", runs[name]))
    a, b = (statistics.median(s["step"] for r in runs[n] for s in r["steps"][1:]) for n in ("1x2", "2x1"))
    print(f"2 ranks x 1 thread / 1 rank x 2 threads: {b / a:.2f}x the step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
