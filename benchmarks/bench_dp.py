"""Data-parallel step time: the trainer's real step at 1 rank x 2 threads vs 2 ranks x 1 thread.

    python benchmarks/bench_dp.py --workflows voting --model src/marlflow/models/toy_model  # toy: 3 rounds x 4 steps
    python benchmarks/bench_dp.py --preset smol --model results/models/smol --workflows voting --steps 3
    python benchmarks/bench_dp.py --quick --model src/marlflow/models/toy_model  # 1 round, 2 steps: checks that it runs

Each round starts the two variants as fresh processes, interleaved and alternating in order (harness.interleaved):
"1x2" is one process with torch at 2 threads; "2x1" is the trainer's own `torchrun --standalone --nproc-per-node 2`
with 1 thread per rank (gloo). Both train the preset's run (the first of --workflows, with --sharing and --task)
with `ranks` set to theirs and sampling_seeds "per_call" (ranks > 1 needs it; the same episodes at any rank
count). Each process builds the trainer as marlflow.cli.train does (`build_trainer` under `distributed.init`) and runs
`trainer.train_step(step)`, the step users run: its share of the problems (distributed.shard) rolled out, the
update with the gradients all-reduced, the gathered train rows. Per step, rank 0 records the trainer's own
step_time, time_generate and time_backward (the update: backward, gradient all-reduce, optimizer step) and the
seconds in marlflow.training.distributed's collectives (gather and all_reduce_sum, which every collective of the step goes
through), wrapped with time.perf_counter: `wait` is the stop agreement right after the rollout
(distributed.stop_agreed), where the faster rank waits for the slower one's rollout (the load imbalance of
uneven episode lengths); `comm` is every collective, that wait included; `comm - wait` also holds any wait for
the slower rank's backward, so comm / step is an upper bound on the communication share. The first step of each
process is a warm-up and not counted. Evaluation and checkpoints are not part of a step (fit() runs them every
eval_every / save_every steps).

`launch` is also benchmarks/ops/gpu_smoke.py's 2-rank check (device cuda: NCCL, one GPU per rank). Run this only
on an otherwise idle machine: the variants compete for the cores with anything else. Results go to
benchmarks/RESULTS.md with the environment line this prints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMES = ("step_time", "time_generate", "time_backward")


def time_collectives(seconds: dict) -> None:
    """Wrap marlflow.training.distributed's collectives (callers reach them through the module) so that each call adds
    its seconds to seconds["comm"], and the stop agreement's to seconds["wait"] as well."""
    from marlflow.training import distributed as D

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - t

        return wrapper

    D.gather, D.all_reduce_sum = timed(D.gather, "comm"), timed(D.all_reduce_sum, "comm")
    D.stop_agreed = timed(D.stop_agreed, "wait")


def worker(cfg_path: str, steps: int, out: str) -> None:
    """One process of a variant (a rank under torchrun): `steps` trainer steps; rank 0 writes `out`: the steps'
    times, the train rows without times (to compare runs) and the peak GPU memory (GB) on cuda."""
    import torch

    from marlflow.cli.train import build_trainer
    from marlflow.core.config import RunConfig
    from marlflow.training import distributed as D

    cfg = RunConfig.load(cfg_path)
    env = D.init(cfg.device)
    seconds: dict = defaultdict(float)
    time_collectives(seconds)
    rec = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, Path(tmp) / f"rank{env.rank}")
        for step in range(1, steps + 1):
            seconds.clear()
            trainer.train_step(step)
            m = {r["metric"]: r["value"] for r in trainer.metric_rows
                 if r["step"] == step and r["role"] == "all" and r["metric"] in TIMES}  # fmt: skip
            rec.append({**m, "wait": seconds["wait"], "comm": seconds["comm"]})
    rows = [
        r for r in trainer.metric_rows if not r["metric"].startswith("time_") and r["metric"] != "step_time"
    ]
    peak = torch.cuda.max_memory_allocated() / 1e9 if cfg.device == "cuda" else None
    peaks = D.gather(peak)
    if D.is_main():
        Path(out).write_text(json.dumps({"world": env.world, "threads": torch.get_num_threads(), "steps": rec,
                                         "rows": rows, "peak_gpu_gb": peaks}))  # fmt: skip
    D.close()


def launch(cfg, ranks: int, threads: int, steps: int, tmp: Path, timeout: float | None = None) -> dict:
    """Run `cfg` at `ranks` x `threads` for `steps` steps in fresh processes; rank 0's record (`worker`). Past
    `timeout` seconds every process is killed and TimeoutError raised."""
    from marlflow.training import distributed as D

    cfg = dataclasses.replace(cfg, ranks=ranks, threads=threads, sampling_seeds="per_call")
    path, out = tmp / f"config-{ranks}x{threads}.json", tmp / f"out-{ranks}x{threads}.json"
    path.write_text(json.dumps(cfg.to_dict()))
    argv = [str(Path(__file__).resolve()), "--worker", str(path), "--steps", str(steps), "--out", str(out)]
    env = {**D.launch_env(os.environ), "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, *argv] if ranks == 1 else [*D.launch_argv(ranks, [], env, cfg.device)[:3], *argv]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and its ranks: no rank is left waiting on a collective
        proc.communicate()
        raise TimeoutError(f"{ranks} x {threads}: not done after {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{stderr[-4000:]}")
    return json.loads(out.read_text())


def medians(runs: list[dict]) -> dict:
    """Median over the counted steps (each process's first is its warm-up) of each time, and the step's range."""
    steps = [s for r in runs for s in r["steps"][1:]]
    med = {k: statistics.median(s[k] for s in steps) for k in (*TIMES, "wait", "comm")}
    return {**med, "lo": min(s["step_time"] for s in steps), "hi": max(s["step_time"] for s in steps),
            "n": len(steps), "share": statistics.median(s["comm"] / s["step_time"] for s in steps)}  # fmt: skip


def main(argv=None) -> int:
    if argv is None and "--worker" in sys.argv:
        a = sys.argv
        worker(a[a.index("--worker") + 1], int(a[a.index("--steps") + 1]), a[a.index("--out") + 1])
        return 0
    from harness import add_cells, interleaved, parser, setup, toy_configs

    ap = add_cells(parser(__doc__))
    ap.add_argument("--preset", default="toy", help="matrix preset whose run is timed (toy, smol)")
    ap.add_argument("--steps", type=int, default=4, help="steps per process, the first a warm-up (default 4)")
    args = setup(ap.parse_args(argv))
    steps = 2 if args.quick else args.steps
    wf = args.workflows[0]
    sharing = "sp" if wf == "single" else args.sharing
    rid, cfg = next((r, c) for r, c in toy_configs(args, args.preset).items()
                    if (c.workflow, c.sharing, c.task_axis) == (wf, sharing, args.task))  # fmt: skip
    print(f"run {rid}: {cfg.grpo.problems_per_step} problems x {cfg.grpo.group_size} rollouts per step, {steps} "
          f"steps per process (the first a warm-up), {args.reps} interleaved round(s)", flush=True)  # fmt: skip
    runs: dict[str, list[dict]] = {"1x2": [], "2x1": []}
    with tempfile.TemporaryDirectory() as tmp:
        interleaved({name: (lambda name=name: runs[name].append(
            launch(cfg, int(name[0]), int(name[2]), steps, Path(tmp)))) for name in runs}, args.reps)  # fmt: skip
    med = {}
    for name, rs in runs.items():
        m = med[name] = medians(rs)
        rounds = [statistics.median(s["step_time"] for s in r["steps"][1:]) for r in rs]
        print(f"{name[0]} rank(s) x {name[2]} thread(s): step {m['step_time']:.2f} s median ({m['lo']:.2f}-"
              f"{m['hi']:.2f} over {m['n']} steps; per round {', '.join(f'{x:.2f}' for x in rounds)}): generate "
              f"{m['time_generate']:.2f}, update {m['time_backward']:.2f}; collectives {m['comm']:.3f} s "
              f"({m['share']:.1%} of the step), of which the wait for the slower rank's rollout "
              f"{m['wait']:.3f}")  # fmt: skip
    print(
        f"2 ranks x 1 thread / 1 rank x 2 threads: {med['2x1']['step_time'] / med['1x2']['step_time']:.2f}x "
        "the step time"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
