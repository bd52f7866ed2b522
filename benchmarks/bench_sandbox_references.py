"""Sandbox verdicts on real data: every reference solution passes, every stub fails, and how many real tests
the sandbox refuses (`error` with a "refused" detail) or judges in its judge process instead of converting.

Data: the 164 HumanEval canonical solutions and stubs (prompt + `pass`) and the 974 MBPP references of
`bench_sandbox.reference_jobs()`; MBPP stubs (the reference's `def`/`class` lines + `pass`, its imports kept);
the DeepCoder fixture (tests/data/deepcoder/primeintellect.jsonl, rows with a reference solution; rows 1, 3,
7 and 11 fail by design, see its README) and stubs of it. Verified by `SandboxPool(2)`, no verdict cache.

    .venv/bin/python benchmarks/bench_sandbox_references.py                 # this checkout
    PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/bench_sandbox_references.py   # another tree
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_sandbox  # noqa: E402


def stub_of(code: str) -> str:
    """The program's imports and `def`/`class` lines, each body replaced by `pass`."""
    out = []
    for ln in code.splitlines():
        if ln.lstrip().startswith(("def ", "class ")):
            out += [ln, " " * (len(ln) - len(ln.lstrip()) + 4) + "pass"]
        elif ln.startswith(("import ", "from ")):
            out.append(ln)
    return "\n".join(out) + "\n" if out else "pass\n"


def groups() -> dict[str, tuple[list[dict], list[dict]]]:
    from marlflow.tasks import deepcoder_runtime as rt

    refs, he_stubs = bench_sandbox.reference_jobs()
    n_he = len(he_stubs)
    mbpp = refs[n_he:]
    dc = []
    rows = (ROOT / "tests/data/deepcoder/primeintellect.jsonl").read_text().splitlines()
    for i, line in enumerate(rows):
        row = json.loads(line)
        sols = rt.solutions_of(row)
        if sols:
            tests = rt.deepcoder_tests(rt.parse_tests(row["tests"], f"row {i + 1}"))
            dc.append({"code": sols[0], "tests": tests, "timeout": 6, "memory_mb": 1024})
    return {
        "humaneval": (refs[:n_he], he_stubs),
        "mbpp": (mbpp, [dict(j, code=stub_of(j["code"])) for j in mbpp]),
        "deepcoder": (dc, [dict(j, code=stub_of(j["code"])) for j in dc]),
    }


def main() -> int:
    import marlflow.sandbox
    from marlflow.sandbox import SandboxPool
    from marlflow.sandbox._verdict import prepare

    print(f"marlflow.sandbox from {Path(marlflow.sandbox.__file__).parent}")
    with SandboxPool(2) as pool:
        for name, (refs, stubs) in groups().items():
            judged = sum(prepare(j).head["mode"] == "judge" for j in refs)
            got_r, got_s = pool.map(refs), pool.map(stubs)
            refused = sum(r.status == "error" and "refused" in r.detail for r in got_r + got_s)
            print(
                f"{name}: references {sum(r.passed for r in got_r)}/{len(refs)} pass, stubs "
                f"{sum(r.passed for r in got_s)}/{len(stubs)} pass; judged (not converted) {judged}; "
                f"refused {refused} of {len(refs) + len(stubs)}"
            )
            for i, r in enumerate(got_r):
                if not r.passed:
                    print(f"  reference {i} (0-based): {r.status}: {r.detail[:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
