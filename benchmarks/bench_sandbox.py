"""Sandbox throughput: MBPP reference solutions verified with the pool vs one at a time.

Measures verifications per second on the 974 MBPP reference solutions (tests/data/mbpp/mbpp.jsonl) with
`SandboxPool(cpu_count)` and with `SandboxPool(1)` (one program at a time), the per-verification
latency of a tiny one-line function (what the toy code task sends ~250 of per step), and the cached
path. Every run uses fresh pools and no verdict cache except where stated; reports medians.

    .venv/bin/python benchmarks/bench_sandbox.py [--runs 3] [--limit 974] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from marlflow import sandbox

ROOT = Path(__file__).resolve().parents[1]


def mbpp_jobs(limit: int) -> list[dict]:
    rows = [json.loads(x) for x in (ROOT / "tests/data/mbpp/mbpp.jsonl").read_text().splitlines()][:limit]
    jobs = []
    for r in rows:
        setup = (r["test_setup_code"] + "\n") if r["test_setup_code"] else ""
        tests = setup + "\n".join(r["test_list"]) + "\n"
        jobs.append(
            {
                "code": r["code"],
                "tests": tests,
                "stdin": None,
                "expect": None,
                "timeout": 10,
                "memory_mb": 1024,
            }
        )
    return jobs


def throughput(jobs: list[dict], workers: int) -> tuple[float, int]:
    with sandbox.SandboxPool(workers) as pool:
        pool.start()
        t0 = time.perf_counter()
        results = pool.map(jobs)
        dt = time.perf_counter() - t0
    return len(jobs) / dt, sum(r.passed for r in results)


def toy_latency(n: int, workers: int) -> dict:
    jobs = [{"code": f"def f(x):\n    return x + {i}\n", "tests": f"assert f(1) == {i + 1}\n", "stdin": None,
             "expect": None, "timeout": 5, "memory_mb": 1024} for i in range(n)]  # fmt: skip
    with sandbox.SandboxPool(workers) as pool:
        pool.start()
        lat = []
        for j in jobs[:50]:  # one at a time: the round-trip latency of a single verification
            t0 = time.perf_counter()
            pool.run(j)
            lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pool.map(jobs)
        batch = time.perf_counter() - t0
    sandbox.clear_cache()
    as_tuples = [(j["code"], j["tests"]) for j in jobs]
    sandbox.verify_many(as_tuples, max_workers=workers)
    t0 = time.perf_counter()
    sandbox.verify_many(as_tuples, max_workers=workers)
    cached = time.perf_counter() - t0
    sandbox.shutdown()
    return {
        "latency_ms_median": 1000 * statistics.median(lat),
        "latency_ms_p90": 1000 * sorted(lat)[int(0.9 * len(lat))],
        "batch_per_s": n / batch,
        "batch_seconds": batch,
        "cached_batch_seconds": cached,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--limit", type=int, default=974)
    ap.add_argument("--toy", type=int, default=250, help="tiny functions per toy batch")
    ap.add_argument("--json", help="write the numbers here too")
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    jobs = mbpp_jobs(a.limit)
    pool_runs, seq_runs, toy_runs, passed = [], [], [], set()
    for _ in range(a.runs):
        v, p = throughput(jobs, cores)
        pool_runs.append(v)
        passed.add(p)
        v, p = throughput(jobs, 1)
        seq_runs.append(v)
        passed.add(p)
        toy_runs.append(toy_latency(a.toy, cores))
    out = {
        "machine": f"{platform.machine()} {cores} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}",
        "landlock_abi": sandbox._LL_ABI,
        "mbpp_jobs": len(jobs),
        "mbpp_passed": sorted(passed),
        "pool_workers": cores,
        "pool_per_s_runs": [round(x, 1) for x in pool_runs],
        "one_at_a_time_per_s_runs": [round(x, 1) for x in seq_runs],
        "pool_per_s_median": round(statistics.median(pool_runs), 1),
        "one_at_a_time_per_s_median": round(statistics.median(seq_runs), 1),
        "ratio": round(statistics.median(pool_runs) / statistics.median(seq_runs), 2),
        "toy": {k: round(statistics.median(t[k] for t in toy_runs), 4) for k in toy_runs[0]},
    }
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
