"""Process isolation of the sandbox: one hostile program per class, each written so
that its test passes only if the attack worked, judged through `verify_many` (and the CLI for some), in
two deployments (this machine as it is, and with Landlock switched off by MARLFLOW_SANDBOX_NO_LANDLOCK),
with and without the audit hook, followed by a pool health check and checks that no process, socket
message or change to the caller outlives the verdict. docs/sandbox.md says which layer holds each class.

    .venv/bin/pytest -q tests/test_sandbox_isolation.py
"""

from __future__ import annotations

import _bisect
import json
import os
import select
import socket
import subprocess
import sys
import time

import pytest
from test_sandbox_hostile import _descendants

from marlflow import sandbox
from marlflow.sandbox import _kernel

# {EXT}: an extension module of the Python install (read-only); copied into the working dir, it would be
# native code the program wrote itself.
PROGRAMS = {
    "extension_from_workdir": (
        "import importlib.util, os, shutil\n"
        "def f():\n"
        "    p = os.path.join(os.getcwd(), 'evil.cpython-311-x86_64-linux-gnu.so')\n"
        "    with open({EXT!r}, 'rb') as src, open(p, 'wb') as dst:\n"
        "        dst.write(src.read())\n"
        "    spec = importlib.util.spec_from_file_location('_bisect', p)\n"
        "    m = importlib.util.module_from_spec(spec)\n"
        "    return 'loaded' if m.bisect_left([1, 2, 3], 2) == 1 else 'no'\n",
        "assert f() == 'loaded'",
    ),
    "fork_and_stay": (
        "import os, time\n"
        "def f():\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.setsid()\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    return 'forked'\n",
        "assert f() == 'forked'",
    ),
    "unix_socket_outside": (
        "import socket\n"
        "def f():\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "    s.connect({SOCK!r})\n"
        "    s.sendall(b'pwned')\n"
        "    return 'sent'\n",
        "assert f() == 'sent'",
    ),
    "memfd_1gib": (
        "import os\n"
        "def f():\n"
        "    fds, total, chunk = [], 0, b'x' * (1 << 20)\n"
        "    while total < (1 << 30):\n"
        "        fd = os.memfd_create('m')\n"
        "        fds.append(fd)\n"
        "        for _ in range(16):\n"  # 16 MiB a file: under RLIMIT_FSIZE
        "            os.write(fd, chunk)\n"
        "            total += len(chunk)\n"
        "    return total >> 20\n",
        "assert f() == 1024",
    ),
    "posix_shm_1gib": (
        "from multiprocessing import shared_memory\n"
        "def f():\n"
        "    m = shared_memory.SharedMemory(create=True, size=1 << 30)\n"
        "    m.buf[::4096] = b'x' * len(m.buf[::4096])\n"
        "    return m.size >> 20\n",
        "assert f() == 1024",
    ),
    "renice_and_pin_caller": (
        "import os\n"
        "def f():\n"
        "    done = []\n"
        "    for name, call in [('pid', lambda: os.setpriority(os.PRIO_PROCESS, {CALLER}, 19)),\n"
        "                       ('pgrp', lambda: os.setpriority(os.PRIO_PGRP, os.getpgid({CALLER}), 19)),\n"
        "                       ('user', lambda: os.setpriority(os.PRIO_USER, os.getuid(), 19)),\n"
        "                       ('affinity', lambda: os.sched_setaffinity({CALLER}, {{0}}))]:\n"
        "        try:\n"
        "            call()\n"
        "            done.append(name)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return done\n",
        "assert f()",
    ),
    "stat_outside": (
        "import os\n"
        "def f():\n"
        "    return [os.stat({SECRET!r}).st_size, os.path.exists({OUTSIDE!r}), os.path.exists('/etc/passwd')]\n",
        "assert f() == [{SECRET_SIZE}, True, True]",
    ),
}
HEALTHY = {
    "code": "def f(x):\n    return x * 2\n",
    "tests": "assert f(21) == 42",
    "timeout": 5,
    "memory_mb": 256,
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("isolation")
    os.chmod(base, 0o777)  # the sandbox may run as "nobody": only the sandbox itself may stop it
    outside = base / "outside"
    outside.mkdir(mode=0o777)
    secret = base / "secret.txt"
    secret.write_text("s3cr3t")
    os.chmod(secret, 0o644)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(base / "sock"))
    os.chmod(base / "sock", 0o777)
    server.listen(8)
    server.setblocking(False)
    subst = {"EXT": _bisect.__file__, "SOCK": str(base / "sock"), "CALLER": str(os.getpid()),
             "SECRET": str(secret), "SECRET_SIZE": str(secret.stat().st_size), "OUTSIDE": str(outside)}  # fmt: skip
    yield {"subst": subst, "server": server, "outside": outside}
    server.close()


def _job(name: str, world: dict, hook: bool = True) -> dict:
    code, tests = PROGRAMS[name]
    s = world["subst"]
    job = {"code": code.format(**s), "tests": tests.format(**s), "timeout": 5, "memory_mb": 256}
    return job if hook else dict(job, audit_hook=False)


def _no_message(server: socket.socket) -> None:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return
    conn.settimeout(1)
    with conn:
        data = conn.recv(100)
    raise AssertionError(f"a sandboxed program connected to a socket outside: {data!r}")


DEPLOYMENTS = {"as_is": {}, "no_landlock": {"MARLFLOW_SANDBOX_NO_LANDLOCK": "1"}}


@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_each_class_is_contained_and_nothing_outlives_it(world, deployment, monkeypatch):
    for k, v in DEPLOYMENTS[deployment].items():
        monkeypatch.setenv(k, v)
    names = list(PROGRAMS)
    prio, affinity = os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0)
    before = _descendants(os.getpid())
    with sandbox.SandboxPool(2) as pool:
        pool.start()
        info = pool._all[0].info
        if deployment == "no_landlock":
            assert info["landlock_abi"] == 0, info
        # Each worker's zygote (docs/sandbox.md) lives as long as its worker.
        workers = {w.proc.pid for w in pool._all} | {w.info.get("zygote") for w in pool._all}
        jobs = [_job(n, world, hook) for hook in (True, False) for n in names]
        got = pool.map(jobs)
        for job, r in zip(jobs, got):
            name = names[jobs.index(job) % len(names)]
            hook = job.get("audit_hook", True)
            assert not r.passed and r.status in ("failed", "crashed", "memory"), (name, hook, r)
            if not hook:
                assert "SandboxViolation" not in r.detail, (name, r.detail)
        assert {w.proc.pid for w in pool._all} <= workers, "a hostile program killed its worker"
        # Nothing the programs forked is alive while the pool still is (the workers' own are gone too; each
        # worker's candidate for its next job waits, cloned ahead).
        leftover = _descendants(os.getpid()) - before - workers - {w.waiting for w in pool._all}
        assert not leftover, f"processes outlive their verdicts: {leftover}"
        assert pool.map([HEALTHY])[0].passed, "the pool must keep working"
    _no_message(world["server"])
    assert os.getpriority(os.PRIO_PROCESS, 0) == prio and os.sched_getaffinity(0) == affinity
    assert not list(world["outside"].iterdir())


def test_verify_many_and_the_command_line_refuse_native_code_and_outside_metadata(world, tmp_path):
    jobs = [
        (_job(n, world)["code"], _job(n, world)["tests"]) for n in ("extension_from_workdir", "stat_outside")
    ]
    got = sandbox.verify_many(jobs, timeout=5, memory_mb=256, cache=False)
    assert [r.status for r in got] == ["failed", "failed"], got
    before = _descendants(os.getpid())
    for name in ("memfd_1gib", "fork_and_stay"):
        job = _job(name, world)
        (tmp_path / "code.py").write_text(job["code"])
        (tmp_path / "tests.py").write_text(job["tests"])
        cmd = [sys.executable, "-m", "marlflow.sandbox", "--code", str(tmp_path / "code.py"),
               "--tests", str(tmp_path / "tests.py"), "--timeout", "5", "--memory-mb", "256"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        assert r["passed"] is False and r["status"] == "failed", r
    assert _descendants(os.getpid()) <= before
    assert sandbox.verify_many([(HEALTHY["code"], HEALTHY["tests"])], cache=False)[0].passed


def test_the_pid_namespace_kills_what_its_first_process_leaves_behind():
    """The kernel layer alone (no seccomp, no hook): the first process of a new PID namespace forks a
    grandchild that holds a pipe open and exits; the kernel must kill the grandchild with it. A helper
    process does it (in a user namespace of its own where this test is not root, as the worker does)."""
    r, w = os.pipe()
    helper = os.fork()
    if helper == 0:  # pragma: no cover - child
        try:
            os.close(r)
            if os.geteuid() != 0:
                _kernel._libc.unshare(_kernel._CLONE_NEWUSER)
            pid = _kernel._fork_isolated()
            if pid == 0:
                if os.fork() == 0:
                    os.setsid()
                    time.sleep(30)
                os._exit(0)
            os.close(w)
            os._exit(3 if pid < 0 else os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        finally:
            os._exit(4)
    os.close(w)
    code = os.waitstatus_to_exitcode(os.waitpid(helper, 0)[1])
    assert code == 0, "this machine refuses PID namespaces: see docs/sandbox.md"
    assert select.select([r], [], [], 5)[0], "a process outlived the namespace's first process"
    assert os.read(r, 1) == b""
    os.close(r)


def test_without_the_kernel_layers_the_pool_refuses_loudly(monkeypatch, capfd):
    monkeypatch.setenv("MARLFLOW_SANDBOX_NO_NAMESPACES", "1")
    with pytest.raises(
        RuntimeError, match="refusing to run untrusted programs: the kernel refused netns, view, pidns"
    ):
        sandbox.SandboxPool(1).start()
    assert "MARLFLOW_SANDBOX_ALLOW_WEAK" in capfd.readouterr().err
    monkeypatch.setenv("MARLFLOW_SANDBOX_ALLOW_WEAK", "1")
    with sandbox.SandboxPool(1) as pool:
        pool.start()
        # As root, with no view the sandbox uid may not reach a Python under /root: then that is missing too.
        assert pool._all[0].info["missing"][:3] == ["netns", "view", "pidns"]
        assert pool.map([HEALTHY])[0].passed


def test_the_audit_hook_keeps_its_own_copies_of_what_it_refuses(tmp_path, monkeypatch):
    """A program can `import marlflow.sandbox._guard` (already loaded: no audit event) and empty or rebind its
    module-level sets; the hook made before the program ran must still refuse. Before: it read them at each
    event, so clearing _BLOCKED_EVENTS let os.system through the hook (the kernel layers still held)."""
    from marlflow.sandbox import _guard

    hook = _guard.make_audit_hook(str(tmp_path), [sys.prefix])
    for name in ("_BLOCKED_EVENTS", "_FRAME_ATTRS", "_PATH_EVENTS", "_PRIVATE_MODULES"):
        monkeypatch.setattr(_guard, name, set())
    monkeypatch.setattr(_guard.os.path, "basename", lambda p: "harmless")
    with pytest.raises(_guard.SandboxViolation, match="os.system"):
        hook("os.system", ("echo pwned",))
    with pytest.raises(AttributeError, match="frame access"):
        hook("object.__getattr__", (object(), "f_back"))
    with pytest.raises(_guard.SandboxViolation, match="outside the working directory"):
        hook("os.remove", ("/etc/passwd",))
    with pytest.raises(ImportError, match="not allowed"):
        hook("import", ("x", "/somewhere/_ctypes.cpython-311-x86_64-linux-gnu.so"))


def test_the_audit_hook_keeps_its_own_builtins_and_exception_classes(tmp_path):
    """A program can rebind builtins (isinstance, any, all, len, str, bool: no audit event) and the guard
    module's exception classes; the hook made before it ran must still refuse, with its own classes. Before:
    `builtins.isinstance = lambda o, t: True` made every path look like an fd the process holds, so the hook let
    writes anywhere through (the kernel layers still held). Run in a child: rebinding builtins would break
    pytest itself."""
    code = f"""
import builtins, sys
from marlflow.sandbox import _guard
hook = _guard.make_audit_hook({str(tmp_path)!r}, [sys.prefix])
class Benign(Exception):
    pass
_guard.SandboxViolation = _guard._NoFrame = Benign
saved = dict(vars(builtins))
builtins.isinstance = lambda o, t: True
builtins.any = lambda it: False
builtins.all = lambda it: True
builtins.len = lambda o: 0
builtins.str = lambda o="": "harmless"
builtins.bool = lambda o=0: False
out = []
for event, args in [("open", (sys.prefix + "/x.txt", "w", 0)), ("open", ("/etc/shadow", "r", 0)),
                    ("os.remove", ("/etc/passwd",)), ("os.system", ("echo",)), ("sys._getframe", ()),
                    ("object.__getattr__", (object(), "f_back"))]:
    try:
        hook(event, args)
        out.append("allowed")
    except BaseException as e:
        out.append(type(e).__name__)
vars(builtins).update(saved)
print(" ".join(out))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["SandboxViolation"] * 4 + ["_NoFrame", "AttributeError"], res.stdout
