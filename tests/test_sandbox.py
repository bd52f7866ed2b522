"""marlflow.sandbox: verdicts, stdio jobs, the command line, the pool and its cache (real sandbox, no mocks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

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
        "error",  # tests that do not compile: the job cannot be judged
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
    other = (SQUARE + "# cache-test\n", "assert square(4) == 17")
    n0 = sandbox.programs_run()
    first = verify_many([job] * 5 + [other] * 3)
    assert sandbox.programs_run() - n0 == 2  # identical jobs in one call run once
    again = verify_many([job] * 50 + [other])
    assert sandbox.programs_run() - n0 == 2  # cached verdicts run nothing
    assert [r.passed for r in first] == [True] * 5 + [False] * 3 and all(r.passed for r in again[:50])
    assert not again[50].passed
    uncached = verify_many([job], cache=False)
    assert sandbox.programs_run() - n0 == 3 and uncached[0].passed
    sandbox.clear_cache()
    verify_many([job])
    assert sandbox.programs_run() - n0 == 4


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


@pytest.mark.slow
def test_parallel_pool_runs_jobs_at_the_same_time():
    # Each job prints when it started and ended; overlap (not wall time) shows the workers ran concurrently.
    jobs = [
        {
            "code": "import time\nt0 = time.time()\ntime.sleep(1.0)\nprint(t0, time.time())\n",
            "tests": f"assert {i} == {i}",
            "timeout": 10,
            "memory_mb": 256,
        }
        for i in range(4)
    ]

    def spans(results):
        assert all(r.passed for r in results), results
        return sorted(tuple(map(float, r.stdout.split())) for r in results)

    with SandboxPool(1) as one, SandboxPool(4) as four:
        one.start(), four.start()
        par = spans(four.map(jobs))
        seq = spans(one.map(jobs))
    assert max(s for s, _ in par) < min(e for _, e in par)  # all four were running at one moment
    assert all(a[1] <= b[0] for a, b in zip(seq, seq[1:]))  # one worker: one after another


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


# ------------------------------------------------------------------ verdicts the program cannot forge


def test_honest_controls_of_the_forgery_shapes_pass():
    """The shapes the hostile corpus attacks pass for honest programs (so the defences are not just 'fail')."""
    jobs = [
        (
            "def solve(x):\n    return x * x\n",
            "assert abs(solve(2.0) - 4.0) < 1e-6\nassert round(solve(1.0), 2) == 1.0",
        ),
        (
            "def solve2():\n    return [2, 1, 2]\n",
            "assert set(solve2()) == set([1, 2])\nassert sorted(solve2()) == [1, 2, 2]",
        ),
        (
            "def solve(i):\n    return 10 * i\n",
            "for i in range(3):\n    assert solve(i) == i * 10",
        ),  # judge fallback
        (
            "import math\ndef f(x):\n    return math.sqrt(x)\n",
            "assert math.isclose(f(2), 1.41421356, rel_tol=1e-6)",
        ),
        (
            "def f(xs):\n    return (x for x in xs)\n",
            "assert list(f([1, 2])) == [1, 2]",
        ),  # generators are drained
        (
            "from collections import Counter\ndef f(s):\n    return Counter(s)\n",
            "assert f('aab') == {'a': 2, 'b': 1}",
        ),
        ("def sum(a, b):\n    return a - b\n", "assert sum(10, 4) == 6"),  # the program's own `sum`
    ]
    rs = verify_many(jobs, cache=False)
    assert [r.status for r in rs] == ["passed"] * len(jobs), [r.detail for r in rs]


def test_strict_encoding_rejects_subclasses_and_keeps_types():
    from marlflow.sandbox._result import from_wire, to_wire

    for v in [1, 1.5, "s", None, True, (1, [2, {3: (4,)}]), {1, 2}, frozenset({3}), b"x", 2j, range(3), int]:
        assert from_wire(json.loads(json.dumps(to_wire(v)))) == v
        assert type(from_wire(to_wire(v))) is type(v)

    class Int(int):
        pass

    for bad in (Int(3), [Int(1)], object(), type("T", (list,), {})()):
        with pytest.raises(TypeError):
            to_wire(bad)
    for forged in ({"t": "ref", "v": "x"}, {"t": "weird", "v": 1}, {"a": 1}, {"t": "tuple", "v": 1}):
        with pytest.raises(ValueError):
            from_wire(forged)


def test_expected_values_never_reach_the_worker():
    from marlflow.sandbox._verdict import prepare

    p = prepare(("def f(x):\n    return x\n", "assert f(12345) == 67890\nassert f('a') == 'zz-expected'"))
    sent = json.dumps([p.head, p.part])
    assert "12345" in sent and "67890" not in sent and "zz-expected" not in sent
    p = prepare(("print(1)", "", "in", "the-expected-out"))
    assert "the-expected-out" not in json.dumps([p.head, p.part])


@pytest.mark.slow
def test_stdio_output_is_compared_whole_up_to_the_limit():
    big = "".join(f"{i} {i * i}\n" for i in range(17000))  # ~170 KB
    prog = "for i in range(17000):\n    print(i, i * i)\n"
    r = verify(prog, "", "", big, cache=False)
    assert len(big) > 160_000 and r.passed, r.detail
    assert len(r.stdout) == sandbox.OUTPUT_CAP  # shown capped, judged whole
    r = verify(prog + "print('garbage')\n", "", "", big, cache=False)
    assert r.status == "failed" and r.detail == "wrong output"
    r = verify("import sys\nsys.stdout.write('1\\n' * (3 << 20))\n", "", "", "1\n", cache=False)
    assert r.status == "output_limit" and not r.passed


@pytest.mark.parametrize(
    "kw",
    [{"timeout": float("nan")}, {"timeout": float("inf")}, {"timeout": 0}, {"timeout": -1}, {"timeout": "abc"},
     {"timeout": 601}, {"memory_mb": -1}, {"memory_mb": 0}, {"memory_mb": 1.5}, {"memory_mb": "1024"}],
)  # fmt: skip
def test_limits_are_validated_and_a_bad_job_never_wedges_the_pool(kw):
    job = dict({"code": SQUARE, "tests": "assert square(2) == 4"}, **kw)
    with pytest.raises(ValueError, match="timeout|memory_mb"):
        verify_many([job], cache=False)
    assert verify_many([(SQUARE, "assert square(2) == 4")], cache=False)[0].passed
    with SandboxPool(1) as pool:
        with pytest.raises(ValueError):
            pool.run(job)
        assert pool.run((SQUARE, "assert square(2) == 4")).passed


def _cli(tmp_path, *args):
    cmd = [sys.executable, "-m", "marlflow.sandbox", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)


@pytest.mark.slow
def test_command_line_bad_arguments_give_one_json_line(tmp_path):
    (tmp_path / "sol.py").write_text(SQUARE)
    (tmp_path / "t.py").write_text("assert square(2) == 4\n")
    (tmp_path / "latin1.py").write_bytes(b"x = '\xe9'\n")
    (tmp_path / "adir").mkdir()
    cases = [
        ["--code", "sol.py", "--tests", "t.py", "--timeout", "nan"],
        ["--code", "sol.py", "--tests", "t.py", "--timeout", "inf"],
        ["--code", "sol.py", "--tests", "t.py", "--memory-mb", "-1"],
        ["--code", "missing.py", "--tests", "t.py"],
        ["--code", "latin1.py", "--tests", "t.py"],
        ["--code", "adir", "--tests", "t.py"],
        ["--code", "sol.py"],
        ["--tests", "t.py"],
    ]
    for args in cases:
        out = _cli(tmp_path, *args)
        assert out.returncode == 2, (args, out)
        assert "Traceback" not in out.stderr + out.stdout, (args, out.stderr)
        lines = out.stdout.strip().splitlines()
        assert len(lines) == 1 and json.loads(lines[0])["error"], (args, out.stdout)
    (tmp_path / "add.py").write_text("print(sum(map(int, input().split())))\n")
    (tmp_path / "in.txt").write_text("2 3\n")
    (tmp_path / "out.txt").write_text("5\n")
    out = _cli(tmp_path, "--code", "add.py", "--stdin", "in.txt", "--expect", "out.txt")  # no --tests
    assert out.returncode == 0 and json.loads(out.stdout)["passed"] is True, out


def test_no_landlock_is_said_once_loudly(capsys, monkeypatch):
    from marlflow.sandbox import _pool

    monkeypatch.setattr(_pool, "_WARNED", [])
    _pool._warn_no_landlock({"landlock_abi": 0})
    _pool._warn_no_landlock({"landlock_abi": 0})
    err = capsys.readouterr().err
    assert err.count("WARNING: this kernel has no Landlock") == 1
    _pool._warn_no_landlock({"landlock_abi": 7})
    assert capsys.readouterr().err == ""


def test_assert_conversion_shapes():
    from marlflow.sandbox import convert

    c = convert("assert f(1) == 2\nassert not g('x')\nassert abs(h(1.5) - 2/3) < 1e-6\nassert k() is True\n")
    assert [x[0] for x in c["calls"]] == ["f", "g", "h", "k"]
    assert [ch["kind"] for ch in c["checks"]] == ["cmp", "falsy", "absdiff", "cmp"]
    he = "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert True\n\ncheck(total)\n"
    assert convert(he, "total")["calls"] == [("total", [[1, 2]], {"t": "dict", "v": []}, [])]
    # wrappers travel with the call (the candidate applies them); the check keeps only the comparison
    c = convert("assert sorted(f(3), reverse=True) == [3, 2]\n")
    assert c["calls"][0][3] == [["sorted", [], {"t": "dict", "v": [["reverse", True]]}]]
    assert "wrappers" not in c["checks"][0]
    assert convert("def check(candidate):\n    assert candidate(1) == helper(1)\ncheck(f)\n", "f") is None
    assert convert("for i in range(3):\n    assert f(i) == i\n") is None  # -> the judge process
    assert convert("x = [1]\nfor i in x:\n    pass\nassert f(1) == 1\n") is None


def test_a_failing_pipe_leaves_no_supervisor_fd_open(tmp_path):
    """When the supervisor cannot make a job's third pipe (too many open files), the two it made before are
    closed: 50 such jobs leave the process's open descriptors as they were. Run in a child process, since
    the supervisor reaps and kills its process's children."""
    code = f"""
import os
from marlflow.sandbox import _supervisor as sv
sv._SUPERVISOR.update(roots=[], tmp={str(tmp_path)!r})
real, calls = os.pipe, []
def pipe():
    calls.append(1)
    if len(calls) % 3 == 0:
        raise OSError(24, "Too many open files")
    return real()
os.pipe = pipe
before = len(os.listdir("/proc/self/fd"))
for _ in range(50):
    try:
        sv.supervise({{"mode": "run", "timeout": 5, "memory_mb": 64}}, lambda: {{}})
    except OSError:
        pass
print(len(calls), before, len(os.listdir("/proc/self/fd")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    calls, before, after = map(int, out.stdout.split())
    assert calls == 150 and after == before, out.stdout
