"""Do two source trees train the same? Short toy runs through each tree's own `train` command, compared byte
for byte: metrics (timing columns aside), samples and the final adapters.

For a refactor that must not change behaviour: check out the old commit in a git worktree, then

    git worktree add /tmp/old d8cedd6
    python benchmarks/ops/same_behaviour.py --old /tmp/old --new . --out /tmp/same

Runs: one per workflow x sharing x task of the `toy` preset and one per intervention of `toy_interventions`
(seed 0), each shortened to --steps steps with an evaluation and a checkpoint every --every steps on a
smaller eval/val split, so the whole check takes minutes on 2 cores. Both trees train the same config.json,
made by the new tree's run sheet; each tree runs as `python -m marlflow train` if it has that command, else
as `python -m marlflow.train`, with PYTHONPATH pointing at its src/. Exit 0 when every run is identical;
otherwise each difference is printed and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
from safetensors.torch import load_file


def configs(new: Path, steps: int, every: int, only: str | None) -> dict[str, dict]:
    """{run id: config dict} of the runs to compare, from the new tree's run sheet."""
    sys.path.insert(0, str(new / "src"))
    from marlflow.pipeline.matrix import run_sheet

    out = {}
    toy = run_sheet(str(new / "matrix.yaml"), "toy")
    itv = run_sheet(str(new / "matrix.yaml"), "toy_interventions", {"seed": [0]})
    itv = itv[itv["task"] == "math"].drop_duplicates("intervention")
    for rid, cfg in [*toy["config"].items(), *itv["config"].items()]:
        if only and only not in rid:
            continue
        c = json.loads(cfg)
        c["grpo"] |= {"steps": steps, "eval_every": every, "save_every": every}
        c["task"] |= {"eval_size": 32, "val_size": 16}
        c["model"] = str((new / "results" / "models" / "toy").resolve())
        out[rid] = c
    return out


def train(tree: Path, cfg: dict, run_dir: Path) -> float:
    """Trains `cfg` with `tree`'s code into `run_dir`; returns the seconds it took."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    verb = ["marlflow", "train"] if (tree / "src/marlflow/cli/train.py").exists() else ["marlflow.train"]
    env = {**os.environ, "PYTHONPATH": str((tree / "src").resolve()), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", *verb, "--config", str(run_dir / "config.json"), "--out", str(run_dir),
           "--log", str(run_dir / "train.log")]  # fmt: skip
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def differences(a: Path, b: Path, volatile: tuple[str, ...]) -> list[str]:
    """What differs between two run folders: metrics without timing rows, samples, final/ adapter tensors."""
    out = []
    ma, mb = (pd.read_parquet(d / "metrics.parquet") for d in (a, b))
    ma, mb = (m[~m["metric"].isin(volatile)].reset_index(drop=True) for m in (ma, mb))
    if not ma.equals(mb):
        out.append(f"metrics differ ({len(ma)} vs {len(mb)} rows)")
    has_samples = (a / "samples.parquet").exists() or (b / "samples.parquet").exists()
    if has_samples and not pd.read_parquet(a / "samples.parquet").equals(
        pd.read_parquet(b / "samples.parquet")
    ):
        out.append("samples differ")
    fa = sorted(p.relative_to(a) for p in (a / "final").rglob("*.safetensors"))
    fb = sorted(p.relative_to(b) for p in (b / "final").rglob("*.safetensors"))
    if fa != fb:
        out.append(f"final adapters differ in files: {fa} vs {fb}")
    for rel in fa if fa == fb else []:
        ta, tb = load_file(a / rel), load_file(b / rel)
        if ta.keys() != tb.keys() or any(not ta[k].equal(tb[k]) for k in ta):
            out.append(f"{rel} differs")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--old", type=Path, required=True, help="the reference tree (e.g. a worktree of the old commit)"
    )
    ap.add_argument("--new", type=Path, default=Path("."), help="the tree under test (default: here)")
    ap.add_argument("--out", type=Path, required=True, help="folder for both trees' run folders")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--every", type=int, default=2, help="evaluate and checkpoint every this many steps")
    ap.add_argument("--only", default=None, help="only run ids containing this text")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(args.new / "src"))
    from marlflow.store.schema import VOLATILE_METRICS

    bad = 0
    for rid, cfg in configs(args.new.resolve(), args.steps, args.every, args.only).items():
        secs = [
            train(tree.resolve(), cfg, args.out / side / rid)
            for side, tree in (("old", args.old), ("new", args.new))
        ]
        diff = differences(args.out / "old" / rid, args.out / "new" / rid, VOLATILE_METRICS)
        bad += bool(diff)
        print(
            f"{rid}: {'identical' if not diff else '; '.join(diff)} (old {secs[0]:.0f} s, new {secs[1]:.0f} s)"
        )
    print(f"{bad} run(s) differ")
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
