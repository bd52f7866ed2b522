"""marlflow.sandbox: verdicts, stdio jobs, the command line, the pool and its cache (real sandbox, no mocks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from marlflow import sandbox
from marlflow.sandbox import SandboxPool, stdio_tests, verify, verify_many

SQUARE = "def square(x):\n    return x * x\n"


def test_statuses():
    jobs = [
        (SQUARE, "assert square(3) == 9"),
        ("def square(x):\n    return x\n", "assert square(3) == 9"),
        ("def square(x) return x", "assert square(3) == 9"),
        ("while True:\n    pass\n", "assert True"),
        ("x = bytearray(8 << 30)\n", "assert True"),
        (SQUARE, "assert square(3) == 9\nimport os\nos._exit(0)"),  # tests that do not finish
        (SQUARE, "def broken(:\n"),
    ]
    rs = verify_many(jobs, timeout=2, memory_mb=256, cache=False)
    assert [r.status for r in rs] == [
        "passed",
        "failed",
        "syntax_error",
        "timeout",
        "memory",
        "failed",
        "crashed",
    ]
    assert [r.passed for r in rs] == [True] + [False] * 6
    assert "AssertionError" in rs[1].detail
    assert all(set(r.to_dict()) >= {"status", "passed", "stdout", "stderr", "seconds", "detail"} for r in rs)


def test_output_is_captured_and_capped():
    r = verify("print('hello')\nimport sys\nsys.stderr.write('x' * 200000)\n", "assert True", cache=False)
    assert r.passed and r.stdout == "hello\n" and len(r.stderr) == sandbox.OUTPUT_CAP


def test_stdio_cases():
    prog = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert verify(prog, stdio_tests([("1 2\n", "3\n"), ("10 20", "30")])).passed
    r = verify(prog, stdio_tests([("1 2\n", "3\n"), ("10 20", "31")]))
    assert r.status == "failed" and r.detail == "wrong output"
    assert verify(prog, "", "2 2\n", "4\n").passed
    assert not verify(prog, "", "2 2\n", "5\n").passed
    # a program printing the right answer and then crashing does not pass
    assert not verify("print(3)\nraise ValueError\n", stdio_tests([("", "3")])).passed
    assert verify(
        "import sys\nprint(sum(map(int, sys.stdin.read().split())))\nsys.exit(0)\n", "", "1 2 3", "6"
    ).passed


def test_outputs_match_is_whitespace_insensitive():
    assert sandbox.outputs_match("1 2\n3\n\n", "1  2\n3")
    assert not sandbox.outputs_match("1 2 3", "1 2\n3")


def test_solution_cannot_read_or_write_outside(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("x")
    r = verify(f"open({str(secret)!r}).read()", "assert True", cache=False)
    assert r.status == "failed" and "cannot open" in r.detail
    ok = verify(
        "import os\ndef f():\n    open('local.txt', 'w').write('hi')\n    return open('local.txt').read(), os.listdir('.')\n",
        "assert f() == ('hi', ['local.txt'])",
        cache=False,
    )
    assert ok.passed, ok


def test_common_stdlib_imports_work():
    code = "import re, heapq, collections, itertools, math, fractions, decimal, json, bisect, functools, string, datetime, socket\n"
    r = verify(code, "assert math.gcd(4, 6) == 2 and re.sub('a', 'b', 'aa') == 'bb'", cache=False)
    assert r.passed, r


def test_cache_and_dedup():
    sandbox.clear_cache()
    job = (SQUARE + "# cache-test\n", "assert square(4) == 16")
    t0 = time.perf_counter()
    first = verify_many([job] * 5)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = verify_many([job] * 50)
    warm = time.perf_counter() - t0
    assert all(r.passed for r in first + again)
    assert warm < cold and warm < 0.05


def test_job_forms():
    rs = verify_many(
        [(SQUARE, "assert square(2) == 4"), {"code": SQUARE, "tests": "assert square(2) == 5", "timeout": 3}]
    )
    assert [r.passed for r in rs] == [True, False]
    with pytest.raises(ValueError):
        verify_many([(SQUARE,)])


def test_pool_replaces_a_dead_worker():
    with SandboxPool(1) as pool:
        w = pool.start()._all[0]
        os.kill(w.proc.pid, signal.SIGKILL)
        r = pool.run(
            {
                "code": SQUARE,
                "tests": "assert square(2) == 4",
                "stdin": None,
                "expect": None,
                "timeout": 3,
                "memory_mb": 256,
            }
        )
        assert r.status == "crashed" and not r.passed
        r = pool.run(
            {
                "code": SQUARE,
                "tests": "assert square(2) == 4",
                "stdin": None,
                "expect": None,
                "timeout": 3,
                "memory_mb": 256,
            }
        )
        assert r.passed and pool._all[0] is not w
    assert w.proc.poll() is not None


def test_parallel_pool_is_faster_than_one_worker():
    jobs = [
        {
            "code": "import time\ntime.sleep(0.3)\n",
            "tests": f"assert {i} == {i}",
            "timeout": 5,
            "memory_mb": 256,
        }
        for i in range(4)
    ]
    with SandboxPool(1) as one, SandboxPool(4) as four:
        one.start(), four.start()
        t0 = time.perf_counter()
        assert all(r.passed for r in four.map(jobs))
        par = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert all(r.passed for r in one.map(jobs))
        seq = time.perf_counter() - t0
    assert seq > 1.2 and par < seq * 0.6


def test_command_line(tmp_path):
    (tmp_path / "sol.py").write_text(SQUARE)
    (tmp_path / "ok.py").write_text("assert square(5) == 25\n")
    (tmp_path / "bad.py").write_text("assert square(5) == 26\n")
    base = [sys.executable, "-m", "marlflow.sandbox", "--code", str(tmp_path / "sol.py"), "--timeout", "3"]
    for tests, passed in (("ok.py", True), ("bad.py", False)):
        out = subprocess.run(
            base + ["--tests", str(tmp_path / tests)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        assert r["passed"] is passed and r["status"] == ("passed" if passed else "failed")
    (tmp_path / "add.py").write_text("print(sum(map(int, input().split())))\n")
    (tmp_path / "in.txt").write_text("2 3\n")
    (tmp_path / "out.txt").write_text("5\n")
    (tmp_path / "empty.py").write_text("")
    cmd = [sys.executable, "-m", "marlflow.sandbox", "--code", str(tmp_path / "add.py"), "--tests", str(tmp_path / "empty.py"),
           "--stdin", str(tmp_path / "in.txt"), "--expect", str(tmp_path / "out.txt")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)["passed"] is True
