"""Sandbox benchmark: reference throughput on HumanEval + MBPP, and the caller's cost per hostile job.

Two measurements, each in a fresh process that imports `marlflow` from a given source tree, so that this
checkout and a baseline (another commit, checked out into a git worktree) are measured alternately in
the same invocation, on the same machine, under the same load:

- throughput: the 164 HumanEval canonical solutions and the 974 MBPP reference solutions verified by
  `SandboxPool(cpu_count)` (no verdict cache), verifications/s; also checks that all of them pass and that
  the 164 HumanEval stubs (prompt + `pass`) fail.
- worker_cpu: CPU time (worker + its reaped children, from /proc) per one-line program sent one at a time
  through `SandboxPool(1)`, 300 programs: the sandbox's own cost per verification.
- hostile: every program of tests/hostile/ and tests/test_sandbox_isolation.py judged one at a time by
  `verify_many(cache=False)`; per job, the caller's wall time, the caller process's CPU time (user+sys,
  all its threads: decoding and judging happen there) and the peak of Python memory the caller allocated
  during the job (tracemalloc). Reports the worst job of each.

    git worktree add --detach /tmp/base <commit>      # the baseline, a real checkout (not a file copy)
    .venv/bin/python benchmarks/bench_sandbox.py --runs 3 --baseline /tmp/base/src [--json out.json]
    git worktree remove /tmp/base

Medians over --runs runs per tree; the runs of the two trees alternate (this, baseline, this, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def reference_jobs() -> tuple[list[dict], list[dict]]:
    """(references, stubs): HumanEval canonical solutions + MBPP references, and HumanEval stubs."""
    he = [json.loads(x) for x in (ROOT / "tests/data/humaneval/test.jsonl").read_text().splitlines()]
    mbpp = [json.loads(x) for x in (ROOT / "tests/data/mbpp/mbpp.jsonl").read_text().splitlines()]
    job = {"timeout": 10, "memory_mb": 1024}
    refs = [
        dict(
            job,
            code=r["prompt"] + r["canonical_solution"],
            tests=f"{r['test']}\n\ncheck({r['entry_point']})\n",
        )
        for r in he
    ]
    for r in mbpp:
        setup = (r["test_setup_code"] + "\n") if r["test_setup_code"] else ""
        refs.append(dict(job, code=r["code"], tests=setup + "\n".join(r["test_list"]) + "\n"))
    stubs = [
        dict(job, code=r["prompt"] + "    pass\n", tests=f"{r['test']}\n\ncheck({r['entry_point']})\n")
        for r in he
    ]
    return refs, stubs


def hostile_jobs(world: Path) -> list[tuple[str, dict]]:
    """Every hostile program the tests hold, with the tests' own placeholders filled in."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_sandbox_hostile as th
    import test_sandbox_isolation as ti

    outside = world / "outside"
    outside.mkdir(mode=0o777)
    (world / "secret.txt").write_text(th.SECRET)
    victim = outside / "victim.txt"
    victim.write_text("keep me")
    subst = {
        "OUTSIDE": str(outside),
        "VICTIM": str(victim),
        "SECRET_FILE": str(world / "secret.txt"),
        "SECRET": th.SECRET,
        "PYTEST_PID": str(os.getpid()),
    }
    jobs = []
    for path in th.HOSTILE:
        code, tests, _ = th._parse(path, subst)
        jobs.append((path.name, {"code": code, "tests": tests}))
    import _bisect

    isub = {
        "EXT": _bisect.__file__,
        "SOCK": str(world / "sock"),
        "CALLER": str(os.getpid()),
        "SECRET": str(world / "secret.txt"),
        "SECRET_SIZE": "1",
        "OUTSIDE": str(outside),
    }
    for name, (code, tests) in ti.PROGRAMS.items():
        jobs.append((name, {"code": code.format(**isub), "tests": tests.format(**isub)}))
    return jobs


def measure(kind: str) -> dict:
    """One measurement in this process (run by `main` in a child with the tree's src on PYTHONPATH)."""
    from marlflow import sandbox

    if kind == "throughput":
        refs, stubs = reference_jobs()
        cores = os.cpu_count() or 1
        with sandbox.SandboxPool(cores) as pool:
            pool.start()
            t0 = time.perf_counter()
            got = pool.map(refs)
            dt = time.perf_counter() - t0
            stub_got = pool.map(stubs)
        return {
            "per_s": len(refs) / dt,
            "seconds": dt,
            "jobs": len(refs),
            "passed": sum(r.passed for r in got),
            "stubs": len(stubs),
            "stubs_passed": sum(r.passed for r in stub_got),
        }
    if kind == "worker_cpu":
        # CPU seconds one worker and its (reaped) children spend per one-line program sent one at a time:
        # the per-verification cost of the sandbox itself, which the machine's load disturbs less than wall.
        jobs = [
            {
                "code": f"def f(x):\n    return x + {i}\n",
                "tests": f"assert f(1) == {i + 1}\n",
                "timeout": 5,
                "memory_mb": 512,
            }
            for i in range(300)
        ]

        def cpu(pid: int) -> float:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime

        with sandbox.SandboxPool(1) as pool:
            pool.start()
            pid = pool._all[0].proc.pid
            c0 = cpu(pid)
            for j in jobs:
                pool.map([j])
            return {"cpu_ms_per_job": 1000 * (cpu(pid) - c0) / len(jobs)}
    import resource
    import tracemalloc

    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)
        jobs = hostile_jobs(Path(tmp))
        sandbox.verify_many([("def f():\n    return 1\n", "assert f() == 1")], cache=False)  # start the pool
        rows = []
        tracemalloc.start()
        for name, job in jobs:
            tracemalloc.reset_peak()
            base_mem = tracemalloc.get_traced_memory()[0]
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            r = sandbox.verify_many([(job["code"], job["tests"])], timeout=2, memory_mb=256, cache=False)[0]
            wall = time.perf_counter() - t0
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
            peak = tracemalloc.get_traced_memory()[1] - base_mem
            rows.append({"name": name, "status": r.status, "wall": wall, "cpu": cpu, "peak_mb": peak / 2**20})
        tracemalloc.stop()
        sandbox.shutdown()
    worst = {k: max(rows, key=lambda x: x[k]) for k in ("wall", "cpu", "peak_mb")}
    return {
        "jobs": len(rows),
        "passed": [x["name"] for x in rows if x["status"] == "passed"],
        "worst_wall_s": [worst["wall"]["name"], round(worst["wall"]["wall"], 3)],
        "worst_caller_cpu_s": [worst["cpu"]["name"], round(worst["cpu"]["cpu"], 3)],
        "worst_caller_peak_mb": [worst["peak_mb"]["name"], round(worst["peak_mb"]["peak_mb"], 2)],
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def run_child(src: str, kind: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, __file__, "--measure", kind],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise SystemExit(f"measurement {kind} with {src} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def git_rev(src: str) -> str:
    out = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", src, "status", "--porcelain", "--", "."], capture_output=True, text=True
    )
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--src", default=str(ROOT / "src"), help="the tree to measure (its src/)")
    ap.add_argument("--baseline", help="a baseline tree's src/ (a git worktree of another commit)")
    ap.add_argument("--json", help="write the numbers here too")
    ap.add_argument("--measure", choices=["throughput", "worker_cpu", "hostile"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure)))
        return 0
    trees = {"this": a.src} | ({"baseline": a.baseline} if a.baseline else {})
    kinds = ("throughput", "worker_cpu", "hostile")
    runs: dict[str, dict[str, list]] = {t: {k: [] for k in kinds} for t in trees}
    for _ in range(a.runs):
        for kind in kinds:
            for t, src in trees.items():
                runs[t][kind].append(run_child(src, kind))
    out = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, uid {os.geteuid()}",
        "load_average": os.getloadavg(),
    }
    for t, src in trees.items():
        th, ho = runs[t]["throughput"], runs[t]["hostile"]
        out[t] = {
            "src": src,
            "commit": git_rev(src),
            "per_s_runs": [round(x["per_s"], 1) for x in th],
            "per_s_median": round(statistics.median(x["per_s"] for x in th), 1),
            "references_passed": sorted({f"{x['passed']}/{x['jobs']}" for x in th}),
            "stubs_passed": sorted({f"{x['stubs_passed']}/{x['stubs']}" for x in th}),
            "worker_cpu_ms_per_job_runs": [round(x["cpu_ms_per_job"], 2) for x in runs[t]["worker_cpu"]],
            "hostile_runs": ho,
        }
    if a.baseline:
        out["ratio_this_over_baseline"] = round(
            out["this"]["per_s_median"] / out["baseline"]["per_s_median"], 3
        )
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
