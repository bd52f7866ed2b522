"""Every diagnostic on a phenomenon induced by construction in real toy training runs, against its matched
null run, over seeds: writes results/evidence/diagnostics/{diagnostics.parquet, provenance.json, table.md}.

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python benchmarks/diagnostics/induced.py [--seeds 0 1 2 3 4]
    .venv/bin/python benchmarks/diagnostics/induced.py --table-only   # table.md again from the parquet

For each seed, each diagnostic's induced and null run (tests/induced/cases.py: the toy preset's cell at a
smaller scale, the shipped model results/models/toy, the inducers of tests/induced/) is trained by the
project's trainer in this process, one run after another, and the diagnostic is read off it with the
project's analysis code. A run that several cases share (Single's null run is the null of cliff, collapse and
stagnation) is trained once per seed. The run folders are scratch (a temporary folder, or --work).

diagnostics.parquet: one row per diagnostic x case (induced / null) x seed x metric (COLUMNS), `flag` the
run's flag for that diagnostic. provenance.json: the command, the commit (the checkout's HEAD when the script
started, "+dirty" with uncommitted changes to tracked files), the seeds, each case's mechanism, each run's id
and wall seconds, and the environments the runs trained in (marlflow.training.environment: torch, CPU model
and flags, threads). table.md: `table(diagnostics)`, which tests/test_induced_diagnostics.py recomputes from
the committed parquet. docs/diagnostics.md explains the mechanisms and quotes the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the inducers live with the tests (tests/induced)
from induced import cases  # noqa: E402

OUT = ROOT / "results" / "evidence" / "diagnostics"
COLUMNS = ["diagnostic", "case", "seed", "metric", "value", "flag"]
CASE_ORDER = ("induced", "null")


def measure(seeds: list[int], work: Path, log=print) -> tuple[pd.DataFrame, list[dict]]:
    """(diagnostics rows (COLUMNS), [{run_id, seed, seconds}] per trained run): every case at every seed."""
    rows, runs = [], []
    for seed in seeds:
        trained: dict[str, Path] = {}  # run id -> its folder: a run that several cases share is trained once
        for name, case in cases.CASES.items():
            for which in CASE_ORDER:
                cfg = cases.config(getattr(case, which), seed)
                if cfg.run_id not in trained:
                    t0 = time.perf_counter()
                    trained[cfg.run_id] = cases.train(cfg, work / cfg.run_id)
                    seconds = time.perf_counter() - t0
                    runs.append({"run_id": cfg.run_id, "seed": seed, "seconds": round(seconds, 1)})
                    log(f"seed {seed}: {cfg.run_id} trained in {seconds:.0f} s")
                for r in cases.readout(name, trained[cfg.run_id]):
                    rows.append({"diagnostic": name, "case": which, "seed": seed, **r})
    return frame(rows), runs


def frame(rows) -> pd.DataFrame:
    """Rows as the committed table's dtypes: strings, int64 seed, float64 value, bool flag."""
    df = pd.DataFrame(list(rows), columns=COLUMNS)
    return df.astype({"diagnostic": str, "case": str, "seed": "int64", "metric": str, "value": "float64",
                      "flag": bool})  # fmt: skip


def _summary(values: pd.Series) -> str:
    """'mean [min, max]' of the finite values, with how many are finite when some are not."""
    v = values[values.map(math.isfinite)]
    if v.empty:
        return "n/a"
    out = f"{v.mean():.3f} [{v.min():.3f}, {v.max():.3f}]"
    return out if len(v) == len(values) else f"{out} ({len(v)} of {len(values)} defined)"


def table(df: pd.DataFrame) -> str:
    """The markdown table of diagnostics.parquet: per diagnostic and metric, the value over seeds (mean [min,
    max]) and the flag rate (runs flagged / runs) of the induced and of the null runs. Diagnostics and metrics
    in the order the rows first name them."""
    seeds = sorted(df["seed"].unique())
    lines = [
        f"Seeds: {', '.join(map(str, seeds))} ({len(seeds)}). Value: mean [min, max] over seeds; flag: runs "
        "flagged / runs.",
        "",
        "| diagnostic | metric | induced value | induced flag | null value | null flag |",
        "|---|---|---|---|---|---|",
    ]
    for diagnostic in dict.fromkeys(df["diagnostic"]):
        d = df[df["diagnostic"] == diagnostic]
        for metric in dict.fromkeys(d["metric"]):
            cells = []
            for which in CASE_ORDER:
                s = d[(d["metric"] == metric) & (d["case"] == which)]
                flags = s.drop_duplicates("seed")["flag"]
                cells += [_summary(s["value"]), f"{int(flags.sum())}/{len(flags)}"]
            lines.append(f"| {diagnostic} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def flag_rates(df: pd.DataFrame) -> dict[tuple[str, str], float]:
    """(diagnostic, case) -> the share of seeds whose run is flagged."""
    runs = df.drop_duplicates(["diagnostic", "case", "seed"])
    return {k: float(g["flag"].mean()) for k, g in runs.groupby(["diagnostic", "case"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="default: %(default)s")
    ap.add_argument("--out", type=Path, default=OUT, help="default: %(default)s")
    ap.add_argument("--work", type=Path, help="run folders (default: a temporary folder, removed after)")
    ap.add_argument("--table-only", action="store_true", help="only write table.md from OUT's parquet")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        (args.out / "table.md").write_text(table(pd.read_parquet(args.out / "diagnostics.parquet")))
        return 0
    logging.basicConfig(level=logging.WARNING)
    cases.use_plugins()
    from marlflow.store.atomic import atomic_write_json, atomic_write_parquet
    from marlflow.training import environment

    # The code this process runs is what it imported at its start: the checkout's HEAD then. The runs' own
    # environment lines name the HEAD at each run's start, which another commit may have moved meanwhile.
    commit, t0 = environment.source_commit(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="induced-") as tmp:
        work = args.work or Path(tmp)
        df, runs = measure(args.seeds, work)
        found, _ = environment.distinct({r["run_id"]: work / r["run_id"] for r in runs})
    skip = ("hosts", "runs", "commit")
    envs = list({json.dumps(e, sort_keys=True): e for e in
                 ({k: v for k, v in f.items() if k not in skip} for f in found)}.values())  # fmt: skip
    atomic_write_parquet(df, args.out / "diagnostics.parquet")
    atomic_write_json(
        args.out / "provenance.json",
        {
            "command": "HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python benchmarks/diagnostics/induced.py "
            + "--seeds "
            + " ".join(map(str, args.seeds)),
            "commit": commit,
            "seeds": args.seeds,
            "cases": {name: case.mechanism for name, case in cases.CASES.items()},
            "model": "results/models/toy",
            "weights_sha256": json.loads(Path("results/models/toy/warmstart.json").read_text())[
                "weights_sha256"
            ],
            "cpu": {"model": envs[0]["cpu_model"], "flags": envs[0]["cpu_flags"]} if envs else {},
            "torch": envs[0]["torch"] if envs else "",
            "threads": sorted({e["torch_threads"] for e in envs}),
            "seconds": round(time.perf_counter() - t0, 1),
            "runs": runs,
            "environments": envs,
        },
    )
    (args.out / "table.md").write_text(table(df))
    print(table(df))
    return 0


if __name__ == "__main__":
    sys.exit(main())
