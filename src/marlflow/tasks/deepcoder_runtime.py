"""DeepCoder test filtering as the paper's code release does it, and the one-time step that makes its input.

The code release (docs/paper-setup.md section 4) keeps only the test cases that passed a runtime check.
It reads `runtime_results.json`, shaped `{str(problem_index): {str(test_index): {"status": "passed" | ...}}}`
over the primeintellect train split in its original order:

- a problem in the file keeps the tests whose status is "passed";
- a problem absent from the file keeps all its tests;
- a problem left with no test is dropped;
- then shuffle(seed=42): the first 1,000 problems are the test split, the rest train.

`marlflow.tasks.code.DeepCoder.load` applies it when `task.runtime_results` names such a file, and turns
each problem's kept tests into sandbox tests with `deepcoder_tests` (which the runtime check uses too). The
authors did not release theirs (it is git-ignored), so this module also rebuilds one: it runs each row's
first reference solution (`solutions[0]`) against each of its tests, one sandbox job per test, and writes the
file in the same format. Problems without a reference solution are left out of the file, so they keep
all their tests. Whether the authors' check also used the first solution is not known. The file is
written atomically every `--batch` problems and a rerun resumes from it (the cache); a sidecar
`<out>.meta.json` records which dataset it belongs to, so that a stale cache is refused:

    python -m marlflow.tasks.deepcoder_runtime --source agentica-org/DeepCoder-Preview-Dataset \\
        --out data/deepcoder/runtime_results.json        # once, on a node with many cores; resumable
    # matrix.yaml: code: {name: deepcoder, source: ..., runtime_results: data/deepcoder/runtime_results.json}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from pathlib import Path

from marlflow import sandbox
from marlflow.tasks.datasets import DataError, Records, source_rows

log = logging.getLogger("marlflow.tasks.deepcoder")
HUB_ID, HUB_CONFIG = "agentica-org/DeepCoder-Preview-Dataset", "primeintellect"


def parse_tests(raw, where: str) -> list[dict]:
    """A row's `tests` field (a JSON string, a list, or TACO's {"inputs", "outputs", "fn_name"}) as a list
    of test dicts; DataError naming the row when it is not that."""
    if raw is None:
        return []
    if hasattr(raw, "tolist") and not isinstance(raw, str):
        raw = raw.tolist()  # parquet gives numpy arrays
    if isinstance(raw, str):
        if not raw.strip():
            return []
        try:
            raw = json.loads(raw)
        except (json.JSONDecodeError, RecursionError) as err:
            msg = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else "too deep"
            raise DataError(
                f"{where}: field 'tests' is not valid JSON ({msg}); it must be a JSON list of "
                '{"type": "stdin_stdout" | "function_call", "input": ..., "output": ...} objects'
            ) from None
    if isinstance(raw, dict):  # TACO style
        ins, outs, fn = raw.get("inputs") or [], raw.get("outputs") or [], raw.get("fn_name")
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise DataError(
                f"{where}: field 'tests' has 'inputs' and 'outputs' that are not lists of one length"
            )
        kind = "function_call" if fn else "stdin_stdout"
        return [{"type": kind, "fn_name": fn, "input": i, "output": o} for i, o in zip(ins, outs)]
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise DataError(f"{where}: field 'tests' must be a list of test objects, got {type(raw).__name__}")
    for j, t in enumerate(raw):
        if "input" not in t or "output" not in t:
            raise DataError(
                f"{where}: test {j} has no 'input' or no 'output' (keys: {', '.join(str(k)[:40] for k in list(t)[:12])})"
            )
    return raw


def solutions_of(row: dict) -> list[str]:
    """The reference solutions of a row: a list, a JSON-encoded list, or one `solution` string."""
    sols = row.get("solutions")
    if hasattr(sols, "tolist") and not isinstance(sols, str):
        sols = sols.tolist()
    if isinstance(sols, str):
        try:
            sols = json.loads(sols) if sols.lstrip().startswith("[") else [sols]
        except json.JSONDecodeError:
            sols = [sols]
    if not sols:
        sols = [row["solution"]] if isinstance(row.get("solution"), str) else []
    return [s for s in sols if isinstance(s, str) and s.strip()]


def load_results(path: str | Path, rows: Records, tests: list[list[dict]]) -> dict[int, dict[int, str]]:
    """Read a runtime results file and check that it fits `rows`: {problem: {test: status}}."""
    p = Path(path)
    key = "task.runtime_results"
    if not p.is_file():
        raise FileNotFoundError(
            f"runtime results file {str(p)!r} does not exist; fix `{key}` in matrix.yaml, or build the file "
            f"once with `python -m marlflow.tasks.deepcoder_runtime --out {p}`, or leave `{key}` empty to keep "
            "every test"
        )
    try:
        doc = json.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise DataError(f"runtime results file {str(p)!r} is not UTF-8 JSON ({err}); rebuild it") from None
    if not isinstance(doc, dict):
        raise DataError(f"runtime results file {str(p)!r} must be a JSON object {{problem: {{test: ...}}}}")
    out: dict[int, dict[int, str]] = {}
    for pk, per_test in doc.items():
        if not (isinstance(pk, str) and pk.isdigit() and int(pk) < len(rows)):
            raise DataError(
                f"runtime results file {str(p)!r}: key {pk!r} is not a problem index 0..{len(rows) - 1} of "
                f"{rows.origin if isinstance(rows, Records) else 'the dataset'}; the file was made for "
                "another dataset (it indexes the primeintellect train split in its original order)"
            )
        i = int(pk)
        if not isinstance(per_test, dict):
            raise DataError(f"runtime results file {str(p)!r}: problem {pk} must map test indices to results")
        out[i] = {}
        for tk, res in per_test.items():
            if not (isinstance(tk, str) and tk.isdigit() and int(tk) < len(tests[i])):
                raise DataError(
                    f"runtime results file {str(p)!r}: problem {pk} has test key {tk!r}, but that problem has "
                    f"{len(tests[i])} tests; the file was made for another version of the dataset"
                )
            status = res.get("status") if isinstance(res, dict) else None
            if not isinstance(status, str):
                raise DataError(
                    f'runtime results file {str(p)!r}: problem {pk} test {tk} needs {{"status": "..."}}'
                )
            out[i][int(tk)] = status
    return out


def keep_passed(tests: list[dict], statuses: dict[int, str] | None) -> list[dict]:
    """The tests the paper keeps: all of them when the problem has no results, else those that passed."""
    if statuses is None:
        return list(tests)
    return [t for j, t in enumerate(tests) if statuses.get(j) == "passed"]


def deepcoder_tests(raw) -> str:
    """Sandbox test code for a DeepCoder `tests` field (JSON string or list); "" when it has none."""
    tests = json.loads(raw) if isinstance(raw, str) else raw
    if isinstance(tests, dict):  # TACO-style {"inputs": [...], "outputs": [...], "fn_name": ...}
        fn = tests.get("fn_name")
        pairs = list(zip(tests.get("inputs", []), tests.get("outputs", [])))
        tests = [
            {"type": "function_call" if fn else "stdin_stdout", "fn_name": fn, "input": i, "output": o}
            for i, o in pairs
        ]
    if not tests:
        return ""
    calls = [t for t in tests if t.get("type") == "function_call" and t.get("fn_name")]
    if calls:
        # Call tests: the sandbox sends each call's arguments to the program and compares its (strictly
        # encoded) return value here with `expected` (JSON-normalised; `[got] == expected` also passes).
        fn = calls[0]["fn_name"]
        cases = []
        for t in calls:
            args = json.loads(t["input"]) if isinstance(t["input"], str) else t["input"]
            exp = json.loads(t["output"]) if isinstance(t["output"], str) else t["output"]
            cases.append([args if isinstance(args, list) else [args], exp])
        return sandbox.CALLS_MARKER + "\n" + json.dumps({"fn": fn, "cases": cases})
    stdio = [(str(t["input"]), str(t["output"])) for t in tests if "input" in t and "output" in t]
    return sandbox.stdio_tests(stdio) if stdio else ""


def fingerprint(rows: Records, tests: list[list[dict]]) -> str:
    h = hashlib.sha256()
    for r, t in zip(rows, tests):
        h.update(json.dumps([str(r.get("problem", "")), t], sort_keys=True, default=str).encode())
    return h.hexdigest()


def compute_results(
    rows: Records, out: Path, timeout: float = 6.0, memory_mb: int = 2048, limit: int = 0, batch: int = 64
) -> dict:
    """Run every row's first reference solution against each of its tests; write and return the results.

    Resumes from `out` when its sidecar says it belongs to the same rows."""
    from marlflow.store.atomic import atomic_write_json

    tests = [
        parse_tests(r.get("tests") if isinstance(r, dict) else None, rows.where(i))
        for i, r in enumerate(rows)
    ]
    meta_path = out.with_name(out.name + ".meta.json")
    meta = {"source": rows.origin, "rows": len(rows), "sha256": fingerprint(rows, tests)}
    results: dict = {}
    if out.exists():
        try:
            old_meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            old_meta = None
        if old_meta != meta:
            raise DataError(
                f"{out} exists but was made for another dataset (or has no {meta_path.name}); delete it or "
                "choose another --out"
            )
        results = json.loads(out.read_text())
    todo = [i for i in range(len(rows)) if str(i) not in results and solutions_of(rows[i]) and tests[i]]
    if limit:
        todo = todo[:limit]
    log.info("%d problems to check (%d cached)", len(todo), len(results))
    atomic_write_json(meta_path, meta)
    for start in range(0, len(todo), batch):
        chunk = todo[start : start + batch]
        jobs, owners = [], []
        for i in chunk:
            sol = solutions_of(rows[i])[0]
            for j, t in enumerate(tests[i]):
                jobs.append((sol, deepcoder_tests([t])))
                owners.append((i, j))
        verdicts = sandbox.verify_many(jobs, timeout=timeout, memory_mb=memory_mb)
        for (i, j), r in zip(owners, verdicts):
            results.setdefault(str(i), {})[str(j)] = {"status": "passed" if r.passed else r.status}
        atomic_write_json(out, results)
        log.info("checked %d/%d problems", min(start + batch, len(todo)), len(todo))
    if not todo:
        atomic_write_json(out, results)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m marlflow.tasks.deepcoder_runtime",
        description="Build the paper's DeepCoder runtime_results.json from reference solutions.",
    )
    ap.add_argument("--source", default=HUB_ID, help="hub id (primeintellect train split) or a local file")
    ap.add_argument("--out", required=True, help="runtime results JSON to write (resumed if it exists)")
    ap.add_argument("--timeout", type=float, default=6.0, help="seconds per test (default 6, as training)")
    ap.add_argument("--memory-mb", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=0, help="check at most this many problems (0 = all)")
    ap.add_argument("--batch", type=int, default=64, help="problems per sandbox batch and per save")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from marlflow.core.config import TaskSpec

    bad = [n for n, v in (("--timeout", args.timeout), ("--memory-mb", args.memory_mb)) if not 0 < v < 1e6]
    bad += [n for n, v in (("--limit", args.limit), ("--batch", args.batch - 1)) if v < 0]
    if bad:
        print(f"marlflow.tasks.deepcoder_runtime: {bad[0]} is out of range", file=sys.stderr)
        return 2
    try:
        rows, _ = source_rows(
            TaskSpec(name="deepcoder", source=args.source), "train", HUB_ID, HUB_CONFIG, "train"
        )
        res = compute_results(rows, Path(args.out), args.timeout, args.memory_mb, args.limit, args.batch)
    except (OSError, ValueError) as err:
        print(f"marlflow.tasks.deepcoder_runtime: {err}", file=sys.stderr)
        return 1
    n_pass = sum(v["status"] == "passed" for per in res.values() for v in per.values())
    n_all = sum(len(per) for per in res.values())
    print(json.dumps({"problems": len(res), "tests": n_all, "passed": n_pass, "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
