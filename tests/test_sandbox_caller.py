"""The trusted caller: no program can crash or stall it, names and arguments behave as
in plain Python, the cache keeps only reproducible verdicts, and bad input is refused as documented.

Each hostile program is judged three ways, as the trainer and users meet it: `task.score()` (the reward),
`verify_many` and the command line (`python -m marlflow.sandbox`). Each way must give a non-passing
verdict of the expected status, keep the caller's own CPU time per job bounded, and leave a pool that
still passes a normal job; at the end no process or sandbox directory outlives the verdicts.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marlflow import sandbox
from marlflow.sandbox import SandboxPool, verify_many
from marlflow.sandbox._result import MAX_SAME_HASH
from marlflow.sandbox._verdict import deterministic, prepare, verdict
from marlflow.tasks import Problem, get_task

CALLER_CPU_S = 2.0  # the caller's own CPU seconds per hostile job (they were seconds to minutes before)
P61 = 2**61 - 1  # hash(k * P61) == 0 for every int k: all keys share one hash

# A program that writes one line (the bytes expression LINE, built in the sandbox) to every file descriptor
# it holds, the result pipe and the judge's answer pipe among them, and exits: the caller (or the judge)
# reads it as the program's answer. Everything after the start line is untrusted data.
FORGE = (
    "import json, os\n"
    "P = 2**61 - 1\n"
    "LINE = {line}\n"
    "for fd in range(3, 64):\n"
    "    try:\n"
    "        os.write(fd, LINE + b'\\n')\n"
    "    except OSError:\n"
    "        pass\n"
    "os._exit(0)\n"
)


def _forge(line: str) -> str:
    return FORGE.format(line=line)


DEEP = 200_000
N_DICT, N_SET = 130_000, 150_000  # as many colliding keys as fit in RESULT_LIMIT
COLLIDING_DICT = (
    f"b'R' + json.dumps(['ok', {{'t': 'dict', 'v': [[k * P, 0] for k in range(1, {N_DICT})]}}]).encode()"
)
COLLIDING_SET = f"b'R' + json.dumps(['ok', {{'t': 'set', 'v': [k * P for k in range(1, {N_SET})]}}]).encode()"

# name -> (program, tests, entry_point, statuses it may get, a correct program for the same tests or None)
HOSTILE = {
    # --- wrong programs rewarded
    "helper_defined_by_tests": (
        "def helper(x):\n    return True\n\ndef f(x):\n    return x\n",
        "def helper(x):\n    return x == 3\n\nassert helper(f(4))\n",
        None,
        {"failed"},
        "def f(x):\n    return x - 1\n",
    ),
    "helper_defined_by_tests_with_entry_point": (
        "def is_small(x):\n    return True\n\ndef f(x):\n    return x\n",
        "def is_small(x):\n    return x < 3\n\ndef check(candidate):\n    assert is_small(candidate(4))\n\ncheck(f)\n",
        "f",
        {"failed"},
        "def f(x):\n    return x - 2\n",
    ),
    "mutates_its_argument": (
        "def f(a):\n    a.sort()\n    return list(a)\n",
        "a = [3, 1, 2]\nassert f(a) == [1, 2, 3]\nassert a == [3, 1, 2], 'f must leave its argument alone'\n",
        None,
        {"failed"},
        "def f(a):\n    return sorted(a)\n",
    ),
    "mutates_a_name_the_tests_use_again": (
        "def f(a):\n    b = list(a)\n    a.clear()\n    return b\n",
        "a = [3, 1]\nassert f(a) == a\n",  # in plain Python the right side is `a` after the call
        None,
        {"failed"},
        "def f(a):\n    return a\n",
    ),
    "returns_its_argument": (
        "def f(a):\n    a.sort()\n    return a\n",
        "b = f([3, 1, 2])\nassert b == [1, 2, 3]\na = [2, 1]\nassert f(a) is not a, 'f must return a new list'\n",
        None,
        {"failed"},
        "def f(a):\n    return sorted(a)\n",
    ),
    "returns_one_list_twice": (
        "def grid(n):\n    return [[0] * n] * n\n",
        "g = grid(2)\ng[0][0] = 1\nassert g == [[1, 0], [0, 0]], 'rows must be separate lists'\n",
        None,
        {"failed"},
        "def grid(n):\n    return [[0] * n for _ in range(n)]\n",
    ),
    # --- crashing the caller
    "undecodable_error_record": (
        _forge(f"b'E{{\"stage\": \"solution\", \"type\": ' + b'[' * {DEEP} + b']' * {DEEP} + b'}}'"),
        "assert f() == 1\n",
        None,
        {"failed"},
        None,
    ),
    "undecodable_answer_to_the_judge": (
        _forge(f"b'[\"err\", {{\"type\": ' + b'[' * {DEEP} + b']' * {DEEP} + b'}}]'"),
        "for i in range(2):\n    assert f(i) == i\n",
        None,
        {"failed"},
        None,
    ),
    "unprintable_failure_message": (
        "def f():\n    raise ValueError('\\ud800 ' + 'x' * 100)\n",
        "assert f() == 1\n",
        None,
        {"failed"},
        None,
    ),
    # --- stalling the caller
    "hash_colliding_dict_keys": (_forge(COLLIDING_DICT), "assert f() == {}\n", None, {"error"}, None),
    "hash_colliding_set_items": (_forge(COLLIDING_SET), "assert f() == set()\n", None, {"error"}, None),
    "sum_of_a_huge_range": (
        "def f():\n    return range(10**18)\n",
        "assert sum(f()) == 0\n",
        None,
        {"timeout"},
        None,
    ),
    "set_of_a_huge_range": (
        "def f():\n    return range(10**12)\n",
        "assert len(set(f())) == 1\n",
        None,
        {"timeout", "memory"},
        None,
    ),
    # --- bad tests (the job, not the program, is wrong): an error verdict, never an exception
    "deeply_nested_tests": ("def f():\n    return 1\n", "assert f() == " + "[" * 5000 + "]" * 5000, None, {"error"}, None),
    "deeply_nested_call_tests": (
        "def f(x):\n    return 1\n",
        sandbox.CALLS_MARKER + '\n{"fn": "f", "cases": [[' + "[" * DEEP + "]" * DEEP + ", 1]]}",
        None,
        {"error"},
        None,
    ),
    "deeply_nested_stdio_tests": ("print(1)\n", sandbox.STDIO_MARKER + "\n" + "[" * DEEP + "]" * DEEP, None, {"error"}, None),
}  # fmt: skip
TIMEOUT = {"sum_of_a_huge_range": 2, "set_of_a_huge_range": 2}
HEALTH = ("def square(x):\n    return x * x\n", "assert square(3) == 9\n")


def _caller_cpu() -> float:
    return time.process_time()  # this process only (all its threads), not the sandbox workers


def _problem(name: str, tests: str, entry_point: str | None) -> Problem:
    return Problem(f"hostile/{name}", "mbpp", "code", "", "", tests=tests, entry_point=entry_point or "")


def _cli(tmp_path: Path, code: str, tests: str, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "code.py").write_text(code, encoding="utf-8", errors="surrogatepass")
    (tmp_path / "tests.py").write_text(tests)
    cmd = [sys.executable, "-m", "marlflow.sandbox", "--code", str(tmp_path / "code.py"), "--tests",
           str(tmp_path / "tests.py"), "--memory-mb", "512", *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def task():
    t = get_task("mbpp")
    t.timeout, t.memory_mb = 5.0, 512
    return t


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_through_score_verify_many_and_cli(name, task, tmp_path):
    code, tests, entry, expect, good = HOSTILE[name]
    timeout = TIMEOUT.get(name, 5)
    job = {"code": code, "tests": tests, "timeout": timeout, "memory_mb": 512}
    if entry:
        job["entry_point"] = entry
    cpu = _caller_cpu()
    r = verify_many([job], cache=False)[0]
    assert _caller_cpu() - cpu < CALLER_CPU_S, f"{name}: the caller spent {_caller_cpu() - cpu:.1f} CPU s"
    assert not r.passed and r.status in expect, (name, r.status, r.detail)
    r.detail.encode("utf-8")  # printable
    print(r.detail)

    task.timeout = float(timeout)
    cpu = _caller_cpu()
    assert task.score([_problem(name, tests, entry)], [f"```python\n{code}```"]) == [0.0]
    assert _caller_cpu() - cpu < CALLER_CPU_S
    if good is not None:  # the same tests pass a correct program (so they can tell the two apart)
        assert task.score([_problem(name, tests, entry)], [f"```python\n{good}```"]) == [1.0], name

    extra = ["--timeout", str(timeout)] + (["--entry-point", entry] if entry else [])
    out = _cli(tmp_path, code, tests, *extra)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and len(lines) == 1 and "Traceback" not in out.stderr, (out.stdout, out.stderr)
    got = json.loads(lines[0])
    assert got["passed"] is False and got["status"] in expect, got

    assert verify_many([HEALTH], cache=False)[0].passed, "the pool must still pass a normal job"


def test_caller_decoding_refuses_colliding_keys_in_bounded_time():
    from marlflow.sandbox._result import Refused, from_wire, parse_record

    for line in (COLLIDING_DICT, COLLIDING_SET):
        text = eval(line, {"json": json, "P": P61})[1:].decode()  # the record the hostile program writes
        assert len(text) < sandbox.RESULT_LIMIT
        t0, cpu = time.perf_counter(), _caller_cpu()
        with pytest.raises(Refused, match="share one hash"):
            from_wire(parse_record(text)[1])
        assert time.perf_counter() - t0 < CALLER_CPU_S and _caller_cpu() - cpu < CALLER_CPU_S
    ok = {"t": "dict", "v": [[k * P61, k] for k in range(MAX_SAME_HASH)]}  # a few collisions are fine
    assert len(from_wire(ok)) == MAX_SAME_HASH
    with pytest.raises(Refused, match="containers"):
        parse_record("[" + "[]," * 300_000 + "[]]")
    with pytest.raises(Refused, match="nested"):
        parse_record("[" * DEEP + "]" * DEEP)


def test_a_signal_without_a_name_is_a_verdict():
    """A program killed by a real-time signal (no name in the signal module): `crashed`, not a ValueError."""
    p = prepare(HEALTH)
    for sig in (33, 40, 63):
        r = verdict(p, {"exit": sig, "res": "S\n", "stdout": "", "stderr": ""})
        assert r.status == "crashed" and f"signal {sig}" in r.detail, r
    judged = prepare(("def f(x):\n    return x\n", "for i in range(2):\n    assert f(i) == i\n"))
    assert judged.head["mode"] == "judge"
    r = verdict(judged, {"exit": 0, "judge_exit": 63, "res": "S\nY\n", "verdict": ""})
    assert r.status == "crashed" and "signal 63" in r.detail, r
    r = verdict(p, {"exit": 0, "res": "S\nR" + "[" * DEEP + "\nZ\n"})  # and a garbage answer: a verdict
    assert not r.passed and r.status in ("failed", "error"), r


def test_names_and_arguments_behave_as_in_plain_python():
    """Correct programs pass tests that rely on mutation, identity and exception types."""
    jobs = [
        ("def f(a):\n    a.sort()\n", "a = [3, 1, 2]\nf(a)\nassert a == [1, 2, 3]\n"),  # in place
        ("def f(d):\n    d['k'] = 1\n", "d = {}\nf(d)\nassert d == {'k': 1}\n"),
        ("def f(s):\n    s.add(2)\n    return s\n", "s = {1}\nassert f(s) is s and s == {1, 2}\n"),
        ("def f(a, b):\n    a.append(b)\n", "x, y = [], [1]\nf(x, y)\nassert x[0] is y\n"),  # shared objects
        ("def f(a):\n    return a\n", "t = ([1],)\nassert f(t) is t\n"),
        ("def f(a):\n    a.append(a)\n", "a = []\nf(a)\nassert a[0] is a\n"),  # a cycle
        (
            "def f(c):\n    c['a'] += 1\n",
            "from collections import Counter\nc = Counter('ab')\nf(c)\n"
            "assert c == Counter({'a': 2, 'b': 1}) and type(c) is Counter\n",
        ),  # fmt: skip
        (
            "def f(x):\n    raise ValueError('no')\n",
            "try:\n    f(1)\nexcept ValueError as e:\n    assert 'no' in str(e)\n"
            "else:\n    raise AssertionError('expected ValueError')\n",
        ),  # fmt: skip
        ("def f(x):\n    return {}[x]\n", "import pytest\nwith pytest.raises(KeyError):\n    f(1)\n"),
        (
            "import json\n\ndef f(x):\n    return json.loads(x)\n",
            "try:\n    f('{')\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError\n",
        ),  # fmt: skip (a JSONDecodeError is a ValueError)
        (
            "def f(x):\n    raise OSError(2, 'gone')\n",
            "try:\n    f(1)\nexcept FileNotFoundError as e:\n    assert e.errno == 2\n",
        ),  # fmt: skip (OSError(2, ...) is a FileNotFoundError in plain Python)
    ]
    unit = ("import unittest\n\nclass T(unittest.TestCase):\n    def test_f(self):\n        with self.assertRaises("
            "ValueError):\n            f(-1)\n        self.assertEqual(f(2), 4)\n\nunittest.main()\n")  # fmt: skip
    right = "def f(x):\n    if x < 0:\n        raise ValueError(x)\n    return x * x\n"
    jobs.append((right, unit))
    rs = verify_many(jobs, cache=False)
    assert [r.status for r in rs] == ["passed"] * len(jobs), [r.detail for r in rs]
    # and programs raising the wrong type (or leaving through SystemExit) fail them
    expects_value_error = next(t for c, t in jobs if "raise ValueError('no')" in c)
    wrong = [("def f(x):\n    raise TypeError('no')\n", expects_value_error), ("def f(x):\n    return x * x\n", unit),
             ("import sys\n\ndef f(x):\n    sys.exit(0)\n", unit)]  # fmt: skip
    assert [r.status for r in verify_many(wrong, cache=False)] == ["failed"] * 3


@pytest.mark.slow
def test_nondeterministic_program_is_never_cached():
    """A program right about 25% of the time gets about 25% with the cache too; a timeout is not kept."""
    code = "import random\n\ndef f():\n    return random.random() < 0.25\n"
    hidden = "r = __import__('ran' + 'dom')\n\ndef f():\n    return r.random() < 0.25\n"
    assert not deterministic(code) and not deterministic(hidden) and deterministic(HEALTH[0], HEALTH[1])
    n = 40
    for prog in (code, hidden):
        sandbox.clear_cache()
        n0 = sandbox.programs_run()
        cached = [verify_many([(prog, "assert f()\n")])[0].passed for _ in range(n)]
        together = [r.passed for r in verify_many([(prog, "assert f()\n")] * n)]
        assert sandbox.programs_run() - n0 == 2 * n, "every run of a random program must be a fresh run"
        # Binomial(40, 0.25) falls outside [1, 30] with p < 2e-5; a frozen verdict gives 0 or 40.
        for passes in (sum(cached), sum(together)):
            assert 1 <= passes <= 30, passes
    n0 = sandbox.programs_run()
    slow = ("def f():\n    while True:\n        pass\n", "assert f()\n")
    assert [verify_many([slow], timeout=1)[0].status for _ in range(2)] == ["timeout", "timeout"]
    assert sandbox.programs_run() - n0 == 2, "a timeout must never be cached"
    n0 = sandbox.programs_run()
    assert all(verify_many([HEALTH])[0].passed for _ in range(3))
    assert sandbox.programs_run() - n0 <= 1, "a deterministic pass is cached"


@pytest.mark.parametrize("tests", ["", "   \n", "# only a comment\n", '"""just a docstring"""\n', "pass\n",
                                   sandbox.STDIO_MARKER + "\n[]", sandbox.CALLS_MARKER + '\n{"fn": "f", "cases": []}'])  # fmt: skip
def test_empty_tests_are_a_usage_error(tests, task, tmp_path):
    with pytest.raises(ValueError, match="tests"):
        verify_many([(HEALTH[0], tests)], cache=False)
    with pytest.raises(ValueError, match="tests"):
        task.score([_problem("empty", tests, None)], ["```python\n" + HEALTH[0] + "```"])
    out = _cli(tmp_path, HEALTH[0], tests)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out
    assert json.loads(lines[0])["status"] == "usage_error"


@pytest.mark.parametrize(
    "kw", [{"timeout": 10**400}, {"timeout": -(10**400)}, {"memory_mb": float("inf")}, {"memory_mb": 10**400},
           {"memory_mb": float("-inf")}, {"timeout": 1e400}, {"memory_mb": 1e300}],
)  # fmt: skip
def test_out_of_range_limits_raise_the_documented_value_error(kw):
    with pytest.raises(ValueError, match="timeout|memory_mb"):
        verify_many([HEALTH], cache=False, **kw)
    with pytest.raises(ValueError, match="timeout|memory_mb"):
        verify_many([dict(code=HEALTH[0], tests=HEALTH[1], **kw)], cache=False)


def test_command_line_entry_point(tmp_path):
    code = "def g(x):\n    return x\n"
    tests = "def check(candidate):\n    for i in range(3):\n        assert candidate(i) == i\n\ncheck(g)\n"
    good = _cli(tmp_path, code, tests, "--entry-point", "g")
    assert json.loads(good.stdout)["passed"] is True, good.stdout
    out = _cli(tmp_path, code, tests, "--entry-point", "not an identifier")
    assert out.returncode == 2 and json.loads(out.stdout)["status"] == "usage_error"


@pytest.mark.slow
def test_nothing_outlives_the_hostile_jobs():
    """After the hostile jobs above (and a fresh pool running them again), no process below this test
    process except the pools' own workers, and no sandbox working directory, is left."""
    from test_sandbox_hostile import _descendants, _sandbox_dirs

    dirs = _sandbox_dirs()
    jobs = [{"code": c, "tests": t, "timeout": TIMEOUT.get(n, 3), "memory_mb": 512, "entry_point": e}
            for n, (c, t, e, _, _) in HOSTILE.items()]  # fmt: skip
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with SandboxPool(2) as pool:
        workers = {w.proc.pid for w in pool.start()._all}
        rs = pool.map(jobs)
        assert not any(r.passed for r in rs)
        assert pool.run(HEALTH).passed
        live = {w.proc.pid for w in pool._all}
        strays = {p for p in _descendants(os.getpid()) - live - workers
                  if b"_serve()" not in Path(f"/proc/{p}/cmdline").read_bytes()}  # fmt: skip
    assert not strays, strays
    extra = _sandbox_dirs() - dirs  # other sandboxes on this machine come and go; ours must not stay
    for _ in range(50):
        extra = {d for d in extra if os.path.exists(d)}
        if not extra:
            break
        time.sleep(0.1)
    assert not extra, f"sandbox working directories left behind: {extra}"
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss) / 1024
    assert grown < 400, f"the caller's peak memory grew {grown:.0f} MiB over the hostile jobs"


def test_a_sandbox_that_cannot_start_raises_instead_of_a_verdict(monkeypatch):
    """Per-job failures are verdicts; a deployment without the kernel layers is not one job's failure."""
    monkeypatch.setenv(
        "MARLFLOW_SANDBOX_NO_NAMESPACES", "1"
    )  # docs/sandbox.md: as if the kernel refused them
    monkeypatch.delenv("MARLFLOW_SANDBOX_ALLOW_WEAK", raising=False)
    with SandboxPool(1) as pool, pytest.raises(sandbox.SandboxUnavailable, match="refusing"):
        pool.map([HEALTH])


def test_the_cache_holds_a_bounded_amount_of_output(monkeypatch):
    from marlflow.sandbox import _pool

    monkeypatch.setattr(_pool, "_CACHE_CHARS", 100_000)
    sandbox.clear_cache()
    jobs = [(f"print('x' * 30000)\n\ndef f():\n    return {i}\n", f"assert f() == {i}\n") for i in range(8)]
    assert all(r.passed and len(r.stdout) > 30000 for r in verify_many(jobs))
    assert 0 < len(_pool._CACHE) < 8 and _pool._CACHED_CHARS[0] <= 100_000
    assert _pool._CACHED_CHARS[0] == sum(_pool._chars(r) for r in _pool._CACHE.values())
    sandbox.clear_cache()
