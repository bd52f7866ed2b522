"""The caller's cost per hostile job: CPU seconds, wall seconds and memory spent in the trainer's process.

Runs every hostile program of tests/test_sandbox_caller.py (HOSTILE) and tests/test_sandbox_round3.py
(CALLER_WORK: a quadratic-regex program, 4 MiB of short stdout lines, big test constants, a flood of
error records) through `verify_many` (cache off),
each in a fresh Python process that imports `marlflow.sandbox` from `--src` (default: this checkout;
give an older checkout's src/ to compare). Reports per job: the status, wall seconds, the caller's own
CPU seconds (time.process_time of that process: its threads, not the sandbox workers), the peak of
the caller's Python allocations during the job (tracemalloc) and its peak RSS (ru_maxrss). A job that
does not finish within --limit seconds is reported as such (the caller was stalled).

    .venv/bin/python benchmarks/bench_sandbox_caller.py [--src src] [--limit 120] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time, tracemalloc
job = json.loads(sys.stdin.read())
from marlflow.sandbox import verify_many
verify_many([("def f():\n    return 1\n", "assert f() == 1\n")], cache=False)  # start the pool first
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
t0, c0 = time.perf_counter(), time.process_time()
try:
    r = verify_many([job], cache=False)[0]
    status = r.status
except BaseException as e:
    status = "raised " + type(e).__name__
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
peak = tracemalloc.get_traced_memory()[1]
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"status": status, "wall_s": round(wall, 3), "caller_cpu_s": round(cpu, 3),
                  "py_peak_mib": round(peak / 2**20, 1), "rss_growth_mib": round((rss - rss0) / 1024, 1)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--src", default=str(ROOT / "src"), help="the src/ folder whose marlflow.sandbox to measure"
    )
    ap.add_argument("--limit", type=float, default=120.0, help="seconds before a job counts as a stall")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from test_sandbox_caller import HOSTILE, TIMEOUT
    from test_sandbox_round3 import CALLER_WORK

    env = dict(os.environ, PYTHONPATH=a.src, OMP_NUM_THREADS="1")
    rows = []
    jobs = {}
    for name, (code, tests, entry, _, _) in HOSTILE.items():
        job = {"code": code, "tests": tests, "timeout": TIMEOUT.get(name, 5), "memory_mb": 512}
        if entry:
            job["entry_point"] = entry
        jobs[name] = job
    for name, (job, _, _) in CALLER_WORK.items():
        jobs[name] = dict({"timeout": 5}, **job, memory_mb=512)
    for name, job in jobs.items():
        try:
            out = subprocess.run(
                [sys.executable, "-c", CHILD],
                input=json.dumps(job),
                capture_output=True,
                text=True,
                timeout=a.limit,
                env=env,
            )
            lines = out.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if lines else {"status": f"no result: {out.stderr.strip()[-200:]}"}
        except subprocess.TimeoutExpired:
            row = {"status": f"stalled: no verdict in {a.limit:g} s"}
        row = {"job": name, **row}
        rows.append(row)
        print(json.dumps(row), flush=True)
    done = [r for r in rows if "caller_cpu_s" in r]
    summary = {
        "src": a.src,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "worst_caller_cpu_s": max((r["caller_cpu_s"] for r in done), default=None),
        "worst_py_peak_mib": max((r["py_peak_mib"] for r in done), default=None),
        "worst_rss_growth_mib": max((r["rss_growth_mib"] for r in done), default=None),
        "not_finished": [r["job"] for r in rows if "caller_cpu_s" not in r],
    }
    print(json.dumps(summary))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
