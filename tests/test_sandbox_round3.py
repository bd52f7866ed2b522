"""Verdicts, round 3: no earlier job in a candidate's memory, kernel resources per job, a caller whose own
situation (fork, threads, umask, fd limits, close) cannot break the pool, the input contract, and bounded
caller work. Each hostile program is written so that its test passes only if the attack worked, is
judged through `verify_many` (and `score()` / the command line where the job can be given there), with
and without the audit hook where native code could do the same, and is followed by a pool health check.

    .venv/bin/pytest -q tests/test_sandbox_round3.py
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc

import pytest

from marlflow import sandbox
from marlflow.sandbox import SandboxPool, verify_many
from marlflow.sandbox._verdict import deterministic, prepare
from marlflow.tasks import Problem, get_task

HEALTH = ("def square(x):\n    return x * x\n", "assert square(3) == 9\n")
HIDDEN = str(10**9 + int.from_bytes(os.urandom(3), "big"))

# Reads the whole malloc heap of its own process (native code: ctypes, with the audit hook off) and counts
# a needle given in two halves (so the job's own text never holds it whole).
SCAN_HEAP = textwrap.dedent(
    """
    import ctypes
    def f(a, b):
        libc = ctypes.CDLL(None)
        libc.sbrk.restype = ctypes.c_void_p
        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
        libc.mallinfo2.restype = Info
        end, size = libc.sbrk(0), libc.mallinfo2().arena
        return ctypes.string_at(end - size, size).count((a + b).encode())
    """
)


def _healthy(**kw) -> None:
    assert verify_many([HEALTH], cache=False, **kw)[0].passed, "the pool must still pass a normal job"


def _cli(tmp_path, code: str, tests: str | None, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "code.py").write_text(code)
    cmd = [sys.executable, "-m", "marlflow.sandbox", "--code", str(tmp_path / "code.py"), *extra]
    if tests is not None:
        (tmp_path / "tests.py").write_text(tests)
        cmd += ["--tests", str(tmp_path / "tests.py")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def task():
    t = get_task("mbpp")
    t.timeout, t.memory_mb = 5.0, 512
    return t


# ------------------------------------------------------------------- 1. no secret in a candidate's memory


def test_no_earlier_job_is_in_a_candidates_memory(task):
    """Job A's tests (judged, holding HIDDEN many times) reach the worker; a later candidate of the same
    worker scans its whole heap for HIDDEN: the zygote it was forked from never held job A."""
    tests = f"for x in [3]:\n    assert g(x) == {HIDDEN}\n" + f"# {HIDDEN}\n" * 3000  # a loop: judged
    first = {"code": "def g(x):\n    return x\n", "tests": tests, "timeout": 5}
    scan = {"code": SCAN_HEAP, "tests": f"assert f({HIDDEN[:5]!r}, {HIDDEN[5:]!r}) == 0\n", "timeout": 5,
            "audit_hook": False}  # fmt: skip
    assert prepare(first).head["mode"] == "judge", "the tests must reach the worker (not converted)"
    for workers in (1, 2):
        assert not verify_many([first], cache=False, max_workers=workers)[0].passed
        # Through the reward too: the tests reach the shared pool's workers the same way.
        assert task.score(
            [Problem("p", "mbpp", "code", "", "", tests=tests)], ["def g(x):\n    return x\n"]
        ) == [0.0]
        got = verify_many([scan, dict(scan, timeout=6)], cache=False, max_workers=workers)
        for r in got:
            assert r.passed, (
                f"an earlier job's hidden value is in a candidate's memory: {r.status} {r.detail}"
            )
        _healthy(max_workers=workers)


# --------------------------------------------------------------------------- 5. kernel resources per job

KERNEL = {
    # name -> program whose f() returns 'pwned' only if the attack worked
    "host_name": "import os\ndef f():\n    return 'pwned' if os.uname().nodename == {HOST!r} else 'no'\n",
    # os.sync() cannot fail (sync(2) returns nothing): the raw syscalls, as native code makes them
    "sync": (
        "import ctypes, os, platform\ndef f():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    nr = {'x86_64': (162, 306), 'aarch64': (81, 267)}[platform.machine()]\n"
        "    fd = os.open('.', os.O_RDONLY)\n"
        "    return 'pwned' if libc.syscall(nr[0]) == 0 and libc.syscall(nr[1], fd) == 0 else 'no'\n"
    ),
    "xattr": (
        "import os\ndef f():\n    open('x', 'w').close()\n"
        "    os.setxattr('x', 'user.a', b'v' * 4000)\n    return 'pwned'\n"
    ),
    "inodes": (
        "import os\ndef f():\n    for i in range(5000):\n        open(str(i), 'w').close()\n    return 'pwned'\n"
    ),
    "flock_shared_file": (
        "import fcntl, os\ndef f():\n    fd = os.open(os.__file__, os.O_RDONLY)\n"
        "    fcntl.flock(fd, fcntl.LOCK_SH)\n    return 'pwned'\n"
    ),
    "lockf_shared_file": (
        "import fcntl, os, struct\ndef f():\n    fd = os.open(os.__file__, os.O_RDONLY)\n"
        "    fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack('hhqqi', fcntl.F_RDLCK, 0, 0, 0, 0))\n    return 'pwned'\n"
    ),
    "page_cache_probe": (
        "import os\ndef f():\n    fd = os.open(os.__file__, os.O_RDONLY)\n"
        "    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)\n"
        "    os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)\n    return 'pwned'\n"
    ),
}


@pytest.mark.parametrize("hook", [True, False], ids=["hook", "kernel_only"])
def test_kernel_resources_are_the_jobs_own(hook, tmp_path):
    jobs = [{"code": c.replace("{HOST!r}", repr(os.uname().nodename)), "tests": "assert f() == 'pwned'\n",
             "timeout": 5, "memory_mb": 256, "audit_hook": hook} for c in KERNEL.values()]  # fmt: skip
    got = verify_many(jobs, cache=False)
    for name, r in zip(KERNEL, got):
        assert not r.passed and r.status in ("failed", "crashed"), (name, r.status, r.detail)
    _healthy()
    if hook:  # the command line too
        for name in ("sync", "flock_shared_file"):
            out = _cli(tmp_path, KERNEL[name], "assert f() == 'pwned'\n")
            assert out.returncode == 0 and json.loads(out.stdout)["passed"] is False, (name, out.stdout)


def test_one_jobs_threads_do_not_fail_another_jobs_correct_program():
    """RLIMIT_NPROC counts the tasks of one uid: candidates of different workers have different uids."""
    hog = ("import threading, time\ndef f():\n    ts = [threading.Thread(target=time.sleep, args=(2.5,)) "
           "for _ in range(60)]\n    [t.start() for t in ts]\n    [t.join() for t in ts]\n    return 1\n")  # fmt: skip
    good = ("import threading\ndef g():\n    ts = [threading.Thread(target=sum, args=([1],)) for _ in range(30)]\n"
            "    [t.start() for t in ts]\n    [t.join() for t in ts]\n    return 2\n")  # fmt: skip
    jobs = [{"code": hog, "tests": "assert f() == 1\n", "timeout": 8},
            {"code": "import time\ntime.sleep(0.8)\n" + good, "tests": "assert g() == 2\n", "timeout": 8}]  # fmt: skip
    with SandboxPool(2) as pool:
        r_hog, r_good = pool.map(jobs)
        assert r_good.passed, (r_good.status, r_good.detail)
        assert pool.run(HEALTH).passed


# Starts as many threads as it can (small stacks, at most 300) and holds them: its test passes only if the job
# got more tasks than its limit. The sibling, started while they are held, needs 30 threads.
TASK_HOG = (
    "import threading, time\ndef f():\n    threading.stack_size(1 << 16)\n    ev, ts = threading.Event(), []\n"
    "    try:\n        for _ in range(300):\n            t = threading.Thread(target=ev.wait, args=(5,))\n"
    "            t.start()\n            ts.append(t)\n    except RuntimeError:\n        pass\n"
    "    time.sleep(2.5)\n    ev.set()\n    [t.join() for t in ts]\n    return len(ts)\n"
)
TASK_SIBLING = (
    "import threading, time\ntime.sleep(0.8)\ndef g():\n    threading.stack_size(1 << 16)\n"
    "    ts = [threading.Thread(target=sum, args=([1],)) for _ in range(30)]\n    [t.start() for t in ts]\n"
    "    [t.join() for t in ts]\n    return len(ts)\n"
)


def test_a_jobs_task_limit_is_counted_per_job(task, tmp_path):
    """Every deployment: a job gets at most TASKS tasks (RLIMIT_NPROC), counted for that job alone (as root a
    uid per worker; unprivileged, where every candidate keeps the caller's uid, a user namespace per candidate:
    the kernel counts tasks per (user namespace, uid)), so a sibling running at the same time starts its 30."""
    from marlflow.sandbox._result import TASKS

    hog = {"code": TASK_HOG, "tests": f"assert f() > {TASKS}\n", "timeout": 10}
    good = {"code": TASK_SIBLING, "tests": "assert g() == 30\n", "timeout": 10}
    with SandboxPool(2) as pool:
        r_hog, r_good = pool.map([hog, good])
        assert r_hog.status == "failed" and f"got {TASKS - 1}" in r_hog.detail, (r_hog.status, r_hog.detail)
        assert r_good.passed, (r_good.status, r_good.detail)
        assert pool.run(HEALTH).passed
    r_hog, r_good = verify_many([hog, good], cache=False, max_workers=2)
    assert not r_hog.passed and r_good.passed, (r_hog.detail, r_good.status, r_good.detail)
    problems = [Problem(n, "mbpp", "code", "", "", tests=j["tests"]) for n, j in (("h", hog), ("g", good))]
    assert task.score(problems, [TASK_HOG, TASK_SIBLING]) == [0.0, 1.0]
    out = _cli(tmp_path, TASK_HOG, hog["tests"], "--timeout", "10")
    assert out.returncode == 0 and json.loads(out.stdout)["passed"] is False, out.stdout
    _healthy()


# --------------------------------------------------------------------------- 2. the caller's situation


def _in_fork() -> bool:
    return verify_many([HEALTH], cache=False)[0].passed


def _default_stop_signals() -> None:
    """A multiprocessing worker's initializer: SIGTERM / SIGUSR1 back to their defaults. Another test of this
    session may have installed marlflow.training.preempt's handlers in this process, which a forked worker
    inherits; they turn SIGTERM into a request to stop at the next step, so Pool.terminate() would wait forever."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


def test_verify_many_in_a_forked_child_runs_or_refuses_never_hangs():
    _healthy()  # the shared pool exists before the fork
    with SandboxPool(1) as own:
        own.start()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                import signal

                signal.alarm(60)
                ok = verify_many([HEALTH], cache=False)[0].passed
                try:
                    own.run(HEALTH)
                    refused = False
                except RuntimeError as e:
                    refused = "fork" in str(e)
                os.write(w, json.dumps([ok, refused]).encode())
            finally:
                os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            assert json.loads(f.read() or "null") == [True, True], f"child exit status {status}"
        assert own.run(HEALTH).passed, "the parent's own pool must be untouched by the child"
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1, initializer=_default_stop_signals) as mp:
        assert mp.apply_async(_in_fork).get(timeout=120)
    _healthy()


def test_workers_outlive_the_thread_that_started_them():
    with SandboxPool(2) as pool:
        t = threading.Thread(target=pool.start)
        t.start()
        t.join()
        pids = {w.proc.pid for w in pool._all}
        time.sleep(0.5)
        assert all(w.proc.poll() is None for w in pool._all), "a worker died with the thread that started it"
        assert all(r.passed for r in pool.map([HEALTH, HEALTH]))
        assert {w.proc.pid for w in pool._all} == pids


def test_close_wakes_every_waiter():
    pool = SandboxPool(1).start()
    slow = ("import time\ndef f():\n    time.sleep(20)\n    return 1\n", "assert f() == 1\n")
    outcomes: list = []

    def run(job):
        try:
            outcomes.append(pool.run(job, timeout=30).status)
        except sandbox.SandboxUnavailable as e:
            outcomes.append(f"unavailable: {e}")

    threads = [threading.Thread(target=run, args=(j,)) for j in (slow, HEALTH, HEALTH)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    pool.close()
    for t in threads:
        t.join(15)
    assert not any(t.is_alive() for t in threads), "a job still waits after close()"
    assert len(outcomes) == 3 and all(o.startswith("unavailable") for o in outcomes), outcomes
    with pytest.raises(RuntimeError):
        pool.run(HEALTH)


CALLER = r"""
import os, resource, sys, json
from marlflow.sandbox import verify_many
os.umask(0o077)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (24, hard))  # the pool starts under fd pressure
root = os.geteuid() == 0
ok = verify_many([("def f():\n    return 1\n", "assert f() == 1\n")], cache=False, max_workers=1)[0].passed
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
uid = ("import os\ndef f():\n    return os.geteuid()\n", "assert f() == 0\n")  # passes only as root
files = ("import os\ndef f():\n    fds = [os.open(str(i), os.O_CREAT | os.O_WRONLY) for i in range(150)]\n"
         "    return len(fds)\n", "assert f() == 150\n")
judged = ("def f(x):\n    return x\n", "for i in range(3):\n    assert f(i) == i\n")
rs = verify_many([uid, files, judged], cache=False, max_workers=1)
print(json.dumps([ok] + [[r.status, r.detail[:200]] for r in rs]))
"""


def test_umask_and_fd_limit_of_the_caller_change_nothing():
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    out = subprocess.run([sys.executable, "-c", CALLER], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    ok, uid, files, judged = json.loads(out.stdout.strip().splitlines()[-1])
    assert ok
    assert uid[0] == "failed", f"the program ran as root under umask 077: {uid}"
    assert files[0] == "passed" and judged[0] == "passed", (files, judged)


# --------------------------------------------------------------------------------- 3. the input contract

FIRST_LINE = [
    "\n" + sandbox.STDIO_MARKER + '\n[["1", "2"]]',
    "\n" + sandbox.CALLS_MARKER + '\n{"fn": "f", "cases": [[[1], 2]]}',
    " " + sandbox.STDIO_MARKER + '\n[["1", "2"]]',
    sandbox.STDIO_MARKER + ' extra\n[["1", "2"]]',
]


@pytest.mark.parametrize("tests", FIRST_LINE)
def test_a_marker_counts_only_as_the_whole_first_line(tests, task, tmp_path):
    code = "def f(x):\n    return 0\nprint(0)\n"
    with pytest.raises(ValueError, match="marker"):
        verify_many([(code, tests)])
    with pytest.raises(ValueError, match="marker"):
        task.score([Problem("p", "mbpp", "code", "", "", tests=tests)], [code])
    out = _cli(tmp_path, code, tests)
    assert out.returncode == 2 and json.loads(out.stdout)["status"] == "usage_error", out.stdout
    _healthy()


def test_conflicting_test_kinds_are_a_usage_error(tmp_path):
    code = "print(input())\ndef f():\n    return 1\n"
    for job in [(code, "assert f() == 2\n", "5", "5"), {"code": code, "tests": "assert f() == 2\n", "expect": "5"},
                (code, sandbox.stdio_tests([("5", "5")]), "5", "5"), {"code": code, "tests": "", "stdin": "5"}]:  # fmt: skip
        with pytest.raises(ValueError, match="job 0"):
            verify_many([job])
    (tmp_path / "in.txt").write_text("5")
    out = _cli(
        tmp_path,
        code,
        "assert f() == 2\n",
        "--stdin",
        str(tmp_path / "in.txt"),
        "--expect",
        str(tmp_path / "in.txt"),
    )
    assert out.returncode == 2 and json.loads(out.stdout)["status"] == "usage_error", out.stdout
    with pytest.raises(ValueError, match="unknown job keys"):
        verify_many([{"code": code, "tests": "assert f() == 1\n", "entrypoint": "f"}])
    _healthy()


def test_call_arguments_must_be_a_list(task):
    code = "def f(*a):\n    return len(a)\n"
    for spec in (
        {"fn": "f", "cases": [["abc", 3]]},
        {"fn": "f", "cases": ["ab"]},
        {"fn": 1, "cases": [[[1], 1]]},
    ):
        tests = sandbox.CALLS_MARKER + "\n" + json.dumps(spec)
        with pytest.raises(ValueError, match="call tests"):
            verify_many([(code, tests)])
        with pytest.raises(ValueError, match="call tests"):
            task.score([Problem("p", "mbpp", "code", "", "", tests=tests)], [code])
    with pytest.raises(ValueError, match="stdio tests"):
        verify_many([("print(1)\n", sandbox.STDIO_MARKER + '\n["ab"]')])
    good = sandbox.CALLS_MARKER + "\n" + json.dumps({"fn": "f", "cases": [[["abc"], 1]]})
    assert verify_many([(code, good)], cache=False)[0].passed


def test_the_cache_key_holds_every_setting_that_changes_a_verdict():
    code = (
        "import sys\ndef f():\n    return sys._getframe(0).f_code.co_name\n"  # refused by the audit hook only
    )
    job = {"code": code, "tests": "assert f() == 'f'\n"}
    sandbox.clear_cache()
    assert not verify_many([job])[0].passed
    assert verify_many([dict(job, audit_hook=False)])[0].passed, (
        "the hook-on verdict was served from the cache"
    )
    sandbox.clear_cache()


@pytest.mark.parametrize("sep", ["\\\n", "\\\r\n", " \\\n  ", "\f"])
def test_the_randomness_filter_sees_through_line_breaks(sep):
    assert not deterministic(f"import{sep} random\ndef f():\n    return random.random()\n")
    assert not deterministic(f"from{sep}random import random\n")
    assert not deterministic(f"from random{sep}import random\n")


# ------------------------------------------------------------------------------ 4. bounded caller work

FLOOD = ("import os\nline = b'E{\"stage\": \"solution\", \"type\": \"X\", \"msg\": \"\", \"line\": 1}\\n'\n"
         "os.write(1, b'')\nfor fd in (3, 4, 5, 6):\n    try:\n        os.write(fd, b'S\\n')\n    except OSError:\n"
         "        pass\nwhile True:\n    for fd in (3, 4, 5, 6):\n        try:\n            os.write(fd, line * 1000)\n"
         "        except OSError:\n            pass\n")  # fmt: skip
CALLER_WORK = {
    # name -> (job, caller CPU seconds at most, caller Python peak MiB at most)
    "quadratic_regex": ({"code": "from " + "." * 10000 + " " * 10000 + "\ndef f():\n    return 1\n",
                         "tests": "assert f() == 2\n"}, 0.5, 64),
    "short_stdout_lines": ({"code": "import sys\nsys.stdout.write('a\\n' * (2 << 20))\n", "tests": "",
                            "stdin": "", "expect": "2\n"}, 1.0, 64),
    "big_constants": ({"code": "def f(x):\n    return 0\n",
                       "tests": "".join(f"assert f([0] * 100000) == {i}\n" for i in range(3000))}, 1.0, 200),
    "error_flood": ({"code": FLOOD, "tests": "assert 1 == 1\n", "timeout": 2}, 1.0, 64),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CALLER_WORK))
def test_the_callers_work_per_hostile_job_is_bounded(name):
    job, cpu_s, peak_mib = CALLER_WORK[name]
    _healthy()
    c0 = time.process_time()  # this process's threads: the caller's own work, not the workers'
    r = verify_many([dict(job, memory_mb=512)], cache=False)[0]
    cpu = time.process_time() - c0
    assert not r.passed, (name, r.status, r.detail)
    assert cpu < cpu_s, f"{name}: the caller spent {cpu:.2f} CPU s"
    tracemalloc.start()  # (a second run: tracing allocations slows the caller down)
    try:
        r = verify_many([dict(job, memory_mb=512)], cache=False)[0]
        peak = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert not r.passed, (name, r.status, r.detail)
    assert peak < peak_mib, f"{name}: the caller's Python memory peaked at {peak:.0f} MiB"
    _healthy()


def test_a_program_that_prints_the_right_answer_between_blank_lines_still_passes():
    r = verify_many([("print('\\n' * 100000 + '2')\n", "", "", "2\n")], cache=False)[0]
    assert r.passed, (r.status, r.detail)
    assert prepare({"code": "x", "tests": "", "stdin": "", "expect": "1"}).cases == [("", "1")]


# ----------------------------------------------------------------- 6. exactly Python's verdict, or a refusal

# name -> (wrong program, tests, a correct program): plain Python fails the first and passes the third.
VERDICTS = {
    "ordered_dict_order": (
        "from collections import OrderedDict\ndef f():\n    d = OrderedDict(a=1, b=2)\n    d.move_to_end('a')\n"
        "    return d\n",
        "r = f()\nassert list(r) == ['a', 'b']\n",
        "from collections import OrderedDict\ndef f():\n    return OrderedDict(a=1, b=2)\n",
    ),
    "ordered_dict_equality": (
        "from collections import OrderedDict\ndef f():\n    return OrderedDict([('b', 2), ('a', 1)])\n",
        "from collections import OrderedDict\nassert f() == OrderedDict([('a', 1), ('b', 2)])\n",
        "from collections import OrderedDict\ndef f():\n    return OrderedDict([('a', 1), ('b', 2)])\n",
    ),
    "check_calls_a_check": (
        "def square(x):\n    return x + 1\ndef candidate(x):\n    return x * x\n",
        "def inner(c):\n    assert c(2) == 4\ndef check(candidate):\n    inner(candidate)\ncheck(square)\n",
        "def square(x):\n    return x * x\n",
    ),
    "check_parameter_shadows_a_builtin": (
        "def f(x):\n    return 0\n",
        "def check(len):\n    assert len([1, 2, 3])\ncheck(f)\n",
        "def f(x):\n    return 1\n",
    ),
    "identity_across_calls": (
        "_cache = []\ndef f():\n    return _cache\n",
        "a = f()\nb = f()\nassert a is not b\n",
        "def f():\n    return []\n",
    ),
    "argument_kept_and_changed_by_a_later_call": (
        "_seen = []\ndef add(a):\n    _seen.append(a)\ndef clear():\n    for x in _seen:\n        x.clear()\n",
        "a = [1]\nadd(a)\nclear()\nassert a == [1]\n",
        "def add(a):\n    pass\ndef clear():\n    pass\n",
    ),
    "kept_argument_changed_by_the_tests": (
        "_kept = []\ndef keep(a):\n    _kept.append(a)\ndef total():\n    return sum(_kept[0])\n",
        "a = [1]\nkeep(a)\na.append(5)\nassert total() == 1\n",
        "_kept = []\ndef keep(a):\n    _kept.append(list(a))\ndef total():\n    return sum(_kept[0])\n",
    ),
    "aliased_argument_rows": (
        "def f(g):\n    g[0][0] = 1\n    return g[1][0]\n",
        "assert f([[0] * 2] * 2) == 0\n",
        "def f(g):\n    return g[1][0]\n",
    ),
}


@pytest.mark.parametrize("name", list(VERDICTS))
def test_verdicts_are_pythons(name, task, tmp_path):
    wrong, tests, right = VERDICTS[name]
    for code, want in ((wrong, False), (right, True)):
        ns: dict = {}
        try:
            exec(compile(code, "<p>", "exec"), ns)
            exec(compile(tests, "<t>", "exec"), ns)
            plain = True
        except Exception:  # noqa: BLE001 - plain Python's verdict
            plain = False
        assert plain is want, f"{name}: the test itself is wrong (plain Python says {plain})"
        assert verify_many([(code, tests)], cache=False)[0].passed is want, name
        assert task.score([Problem("p", "mbpp", "code", "", "", tests=tests)], [code]) == [float(want)]
    out = _cli(tmp_path, wrong, tests)
    assert out.returncode == 0 and json.loads(out.stdout)["passed"] is False, out.stdout
    _healthy()


def test_an_iterator_consumed_after_its_inputs_changed_is_refused(task, tmp_path):
    """The candidate drains a returned iterator when the call returns; plain Python runs it lazily. Where
    the two could differ (the tests change the arguments, or call the program again, before consuming
    it), the job is refused with the reason, whatever the program; where they cannot, it is judged."""
    lazy_wrong = "def f(a):\n    return (x for x in a)\n"  # plain Python: sees the appended 2, fails
    copy_right = "def f(a):\n    return iter(list(a))\n"  # plain Python: passes
    tests = "a = [1]\ng = f(a)\na.append(2)\nassert list(g) == [1]\n"
    again = "a = [1]\ng = f(a)\nf([5])\ntry:\n    assert list(g) == [1]\nexcept BaseException:\n    pass\n"
    for code in (lazy_wrong, copy_right):
        for t in (tests, again):
            r = verify_many([(code, t)], cache=False)[0]
            assert r.status == "error" and "refused" in r.detail, (code, t, r.status, r.detail)
            assert task.score([Problem("p", "mbpp", "code", "", "", tests=t)], [code]) == [0.0]
    out = _cli(tmp_path, lazy_wrong, tests)
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "error", out.stdout
    fine = "a = [1]\nassert list(f(a)) == [1]\nfor x in f([2, 3]):\n    assert x in (2, 3)\n"
    assert verify_many([(lazy_wrong, fine)], cache=False)[0].passed
    _healthy()


# A program with classes of its own; in the judge, its objects cross as stand-ins (`_child._Remote`).
OBJECTS = textwrap.dedent(
    """
    class Pair:
        def __init__(self, a, b):
            self.a, self.b = a, b
        def total(self):
            return self.a + self.b
        def __eq__(self, other):
            return True
    class Node:
        def __init__(self, v, nxt=None):
            self.val, self.next = v, nxt
    def length(n):
        k = 0
        while n is not None:
            k, n = k + 1, n.next
        return k
    def widest(ps):
        return max(ps, key=lambda p: p.b - p.a)
    def make_adder(n):
        return lambda x: x + n
    class Solution:
        def twoSum(self, nums, t):
            seen = {}
            for i, x in enumerate(nums):
                if t - x in seen:
                    return [seen[t - x], i]
                seen[x] = i
    """
)
# name -> (tests, plain Python's verdict): the tests loop, so they are judged, not converted.
OBJECT_TESTS = {
    "passed_back_and_identity": ("for _ in range(2):\n    ps = [Pair(1, 5), Pair(2, 3)]\n"
                                 "    assert widest(ps) is ps[0] and widest(ps).total() == 6\n", True),
    "attributes_set_and_read": ("for _ in range(2):\n    n = Node(1)\n    n.next = Node(2)\n"
                                "    assert length(n) == 2 and n.next.val == 2 and n.next.next is None\n", True),
    "a_returned_function": ("for i in range(2):\n    assert make_adder(5)(i) == 5 + i\n", True),
    "leetcode_style": ("s = Solution()\nfor _ in range(2):\n    assert s.twoSum([2, 7, 11], 9) == [0, 1]\n", True),
    "a_wrong_method_answer": ("for _ in range(2):\n    assert Pair(1, 2).total() == 4\n", False),
}  # fmt: skip
# Plain Python would run the object's own code on the tests' side (here an `==` that always says yes): refused.
OBJECT_REFUSED = {
    "eq": "for _ in range(2):\n    assert Pair(1, 2) == 7\n",
    "str": "for _ in range(2):\n    print(Pair(1, 2))\n",
    "isinstance": "for _ in range(2):\n    assert not isinstance(Node(1), list)\n",
    "isinstance_of_its_class": "for _ in range(2):\n    assert isinstance(Node(1), Node)\n",
}


def test_objects_of_the_programs_own_classes_are_judged_as_python_judges_or_refused(task, tmp_path):
    """Objects of the program that are not plain builtin values (its classes' instances, a function it
    returns) no longer fail a correct program: in the judge the tests can pass them back, call them, read and
    set their attributes and compare them with `is`, each asked of the program, as plain Python runs them.
    What plain Python would decide with the object's own methods on the tests' side (`==`, str, isinstance)
    is refused with the reason (`error`), never judged by the program's code."""
    for name, (tests, want) in OBJECT_TESTS.items():
        ns: dict = {}
        try:
            exec(compile(OBJECTS + tests, "<p>", "exec"), ns)
            plain = True
        except AssertionError:
            plain = False
        assert plain is want, f"{name}: the test itself is wrong (plain Python says {plain})"
        assert prepare({"code": OBJECTS, "tests": tests}).head["mode"] == "judge", name
        r = verify_many([(OBJECTS, tests)], cache=False)[0]
        assert r.passed is want and r.status == ("passed" if want else "failed"), (name, r.status, r.detail)
        assert task.score([Problem("p", "mbpp", "code", "", "", tests=tests)], [OBJECTS]) == [float(want)]
    for name, tests in OBJECT_REFUSED.items():
        r = verify_many([(OBJECTS, tests)], cache=False)[0]
        assert r.status == "error" and r.detail.startswith("refused:"), (name, r.status, r.detail)
        assert task.score([Problem("p", "mbpp", "code", "", "", tests=tests)], [OBJECTS]) == [0.0]
    out = _cli(tmp_path, OBJECTS, OBJECT_TESTS["leetcode_style"][0])
    assert out.returncode == 0 and json.loads(out.stdout)["passed"] is True, out.stdout
    out = _cli(tmp_path, OBJECTS, OBJECT_REFUSED["eq"])
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "error", out.stdout
    _healthy()
