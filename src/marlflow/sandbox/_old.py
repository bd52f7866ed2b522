"""Run untrusted, model-written Python against tests; the harness, not the program, decides `passed`.

Every program runs in a fresh forked process in its own session and process group, with CPU-time,
address-space, process-count and file-size limits, a throwaway working directory, a scrubbed
environment, capped output, no network and a wall-clock deadline after which the whole group is
killed. The layers, strongest first (each one that the kernel refuses is skipped, the rest still hold):

- kernel: a new network namespace (no interfaces but a downed loopback); when run as root, the program
  drops to uid/gid 65534; Landlock (Linux >= 5.13) limits file access to reading the Python install and
  read/write in the working directory, forbids execve, TCP and (ABI >= 6) signals to outside processes;
  no_new_privs; rlimits; the supervising worker is a child subreaper and kills escaped descendants;
- interpreter: an audit hook (it cannot be removed) refuses sockets, fork/exec/subprocess, ctypes,
  code-object construction, frame and gc introspection, tracing, and file writes outside the working dir;
- verdict: success is a secret 32-byte nonce that only the harness writes to a private pipe after every
  test ran; tests run in their own globals with fresh builtins captured before the program ran,
  after common stdlib modules are restored, signal handlers reset and leftover threads rejected.

Statuses: passed, failed, timeout, memory, crashed, syntax_error. `tests` is Python run after the
solution. Tests starting with the line `# marlflow: stdio` are stdin/stdout cases instead (see
`stdio_tests`): the program runs once per case with that stdin and its stdout is compared by the
supervisor.

Python API (the trainer calls `verify_many` every step; identical jobs are cached):

    from marlflow.sandbox import verify_many
    results = verify_many([(code, tests), (code2, "", stdin, expected)], timeout=5, memory_mb=1024)

Command line (prints one JSON object, exits 0 whatever the verdict):

    python -m marlflow.sandbox --code sol.py --tests tests.py [--stdin in.txt --expect out.txt]
        [--timeout 5] [--memory-mb 1024]
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import collections
import contextlib
import ctypes
import gc
import hashlib
import io
import json
import os
import queue
import resource
import secrets
import selectors
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

STATUSES = ("passed", "failed", "timeout", "memory", "crashed", "syntax_error")
STDIO_MARKER = "# marlflow: stdio"
SANDBOX_UID = 65534  # "nobody"; used only when the supervisor runs as root
OUTPUT_CAP = 64 * 1024  # bytes of stdout/stderr kept in a result
OUTPUT_HARD_LIMIT = 8 * 1024 * 1024  # a program that prints more than this is killed
TMP_PREFIX = "marlflow-sbx-"
WORKDIR_MB = 64  # size of the per-program tmpfs working directory
_CACHE_SIZE = 65536


@dataclass(frozen=True)
class SandboxResult:
    """Verdict of one job. `passed` is True only when every test ran and succeeded."""

    status: str
    passed: bool
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def stdio_tests(cases) -> str:
    """Encode stdin/stdout cases [(stdin, expected_stdout), ...] as a `tests` string."""
    return STDIO_MARKER + "\n" + json.dumps([[str(i), str(o)] for i, o in cases])


def outputs_match(got: str, expected: str) -> bool:
    """Whitespace-insensitive line comparison, the usual rule for competitive-programming judges."""
    g = [ln.split() for ln in got.strip().splitlines()]
    e = [ln.split() for ln in expected.strip().splitlines()]
    return [x for x in g if x] == [x for x in e if x]


# --------------------------------------------------------------------------------------------------
# Kernel helpers (ctypes; Python 3.11 has no os.unshare)

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWUSER, _CLONE_NEWNET, _CLONE_NEWNS = 0x10000000, 0x40000000, 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 0x4000, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 1, 38, 36
_SYS_LANDLOCK = (444, 445, 446)  # create_ruleset, add_rule, restrict_self (same on all Linux arches)


def _prctl(option: int, arg: int) -> bool:
    return _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0


def _unshare_network() -> bool:
    """Move this (single-threaded) process into a new, empty network namespace."""
    if not sys.platform.startswith("linux"):
        return False
    if os.geteuid() == 0 and _libc.unshare(_CLONE_NEWNET) == 0:
        return True
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        return False
    # Map our own ids so files we create keep their owner (optional; failure is harmless).
    for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with contextlib.suppress(OSError), open(f"/proc/self/{path}", "w") as f:
            f.write(text)
    return True


def _drop_capabilities() -> bool:
    """Clear the effective, permitted and inheritable capability sets (capset(2), version 3)."""
    header = struct.pack("Ii", 0x20080522, 0)
    data = bytes(24)  # two empty {effective, permitted, inheritable} u32 triples
    return _libc.capset(header, data) == 0


def _landlock_abi() -> int:
    if not sys.platform.startswith("linux"):
        return 0
    v = _libc.syscall(_SYS_LANDLOCK[0], None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(v), 0)


_LL_ABI = _landlock_abi()


def _landlock(read_roots: list[str], rw_dir: str, rw_files: list[str]) -> bool:
    """Restrict this process: read-only `read_roots`, read-write `rw_dir`, no execve, no TCP."""
    abi = _LL_ABI
    if abi < 1:
        return False
    fs_all = (1 << 13) - 1
    if abi >= 2:
        fs_all |= 1 << 13  # REFER
    if abi >= 3:
        fs_all |= 1 << 14  # TRUNCATE
    if abi >= 5:
        fs_all |= 1 << 15  # IOCTL_DEV
    read_dir = (1 << 2) | (1 << 3)
    file_rw = (1 << 1) | (1 << 2) | (fs_all & (1 << 14))
    fields = [fs_all]
    if abi >= 4:
        fields.append(0b11)  # handle TCP bind + connect, allow none
    if abi >= 6:
        fields.append(0b11)  # scope abstract unix sockets and signals to this domain
    attr = struct.pack(f"{len(fields)}Q", *fields)
    fd = _libc.syscall(_SYS_LANDLOCK[0], attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if fd < 0:
        return False
    try:
        rules = (
            [(p, read_dir) for p in read_roots] + [(rw_dir, fs_all & ~1)] + [(p, file_rw) for p in rw_files]
        )
        for path, access in rules:
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if not os.path.isdir(path):
                    access &= file_rw
                rule = struct.pack("=Qi", access, pfd)
                _libc.syscall(_SYS_LANDLOCK[1], fd, ctypes.c_int(1), rule, ctypes.c_uint32(0))
            finally:
                os.close(pfd)
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        return _libc.syscall(_SYS_LANDLOCK[2], fd, ctypes.c_uint32(0)) == 0
    finally:
        os.close(fd)


def _read_roots() -> list[str]:
    import sysconfig

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError):
            roots.add(sysconfig.get_paths()[key])
    roots |= {p for p in sys.path if p and os.path.isdir(p) and "site-packages" in p}
    return sorted({os.path.realpath(r) for r in roots if os.path.isdir(r)} - {"/"})


# --------------------------------------------------------------------------------------------------
# The child: harness + untrusted code, in one forked process

# Modules whose attributes tests rely on; restored before tests so a solution cannot patch them.
_GUARDED = [
    "builtins",
    "math",
    "cmath",
    "re",
    "collections",
    "itertools",
    "functools",
    "heapq",
    "string",
    "operator",
    "random",
    "bisect",
    "statistics",
    "decimal",
    "fractions",
    "json",
    "copy",
    "typing",
    "sys",
    "os",
    "hashlib",
    "array",
    "numbers",
    "abc",
    "enum",
]
for _m in _GUARDED:
    __import__(_m)
_MODULE_SNAPSHOT = {m: (sys.modules[m], dict(sys.modules[m].__dict__)) for m in _GUARDED}
_BUILTINS = dict(builtins.__dict__)
_FRAME_ATTRS = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"}
_BLOCKED_EVENTS = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
    "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__", "socket.connect",
    "socket.bind", "socket.getaddrinfo", "socket.sendto", "sys.settrace", "sys.setprofile",
    "sys._current_frames", "sys._current_exceptions", "sys.addaudithook", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents", "code.__new__",
    "resource.setrlimit", "resource.prlimit", "os.setuid", "os.setgid", "os.chroot", "os.symlink",
    "os.link", "sys.remote_exec",
}  # fmt: skip
_PATH_EVENTS = {
    "os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown", "os.utime",
    "os.truncate", "shutil.rmtree", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr",
}  # fmt: skip


class SandboxViolation(PermissionError):
    """Raised inside the sandbox for a refused operation (an OSError, so stdlib fallbacks work)."""


class _NoFrame(ValueError):
    # namedtuple, typing and enum call sys._getframe inside `except (AttributeError, ValueError)`.
    pass


def _make_audit_hook(workdir: str, read_roots: list[str]):
    """Audit hook for the untrusted program. Its state lives only in this closure."""
    wd = workdir.rstrip("/") + "/"
    ok_read = tuple(r.rstrip("/") + "/" for r in read_roots) + (wd, "/dev/null", "/dev/urandom", "/dev/zero")
    ok_write = (wd, "/dev/null")
    abspath, fspath, getcwd = os.path.abspath, os.fspath, os.getcwd
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path, allowed) -> bool:
        if isinstance(path, int):
            return True  # an fd the process already holds
        try:
            p = fspath(path)
            if isinstance(p, bytes):
                p = p.decode("utf-8", "surrogateescape")
            p = abspath(p if p.startswith("/") else getcwd() + "/" + p)
        except Exception:
            return False
        return (p + "/").startswith(allowed) or p in {a.rstrip("/") for a in allowed}

    def hook(event: str, args) -> None:
        if event in _BLOCKED_EVENTS or event.startswith(("ctypes.", "os.exec", "os.spawn", "os.posix_spawn")):
            raise SandboxViolation(f"sandbox: {event} is not allowed")
        if event == "sys._getframe":
            raise _NoFrame("sandbox: frame access is not allowed")
        if event == "object.__getattr__" and len(args) > 1 and args[1] in _FRAME_ATTRS:
            raise AttributeError("sandbox: frame access is not allowed")
        if event == "import" and args and args[0] in ("_posixsubprocess", "_ctypes", "_xxsubinterpreters"):
            raise ImportError(f"sandbox: module {args[0]} is not allowed")
        if event == "open" and args:
            mode, flags = (args[1] if len(args) > 1 else "r") or "", args[2] if len(args) > 2 else 0
            writing = any(c in str(mode) for c in "wax+") or bool((flags or 0) & write_flags)
            if not inside(args[0], ok_write if writing else ok_read):
                raise SandboxViolation(f"sandbox: cannot open {args[0]!r} ({'write' if writing else 'read'})")
        elif event in ("os.listdir", "os.scandir") and args:
            if not inside(args[0] if args[0] is not None else ".", ok_read):
                raise SandboxViolation(f"sandbox: cannot list {args[0]!r}")
        elif event in _PATH_EVENTS:
            paths = [a for a in args[:2] if isinstance(a, str | bytes | os.PathLike)]
            if not paths or not all(inside(p, ok_write) for p in paths):
                raise SandboxViolation(f"sandbox: {event} outside the working directory is not allowed")

    return hook


def _restore_modules() -> None:
    for name, (mod, snap) in _MODULE_SNAPSHOT.items():
        sys.modules[name] = mod
        d = mod.__dict__
        if len(d) != len(snap) or any(d.get(k, d) is not v for k, v in snap.items()):
            d.clear()
            d.update(snap)
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, types.ModuleType):
            del sys.modules[name]


def _child(job: dict, nonce: bytes, res_fd: int, out_fd: int, err_fd: int, workdir: str, roots: list[str]):
    """Runs in the forked child; never returns. Everything the verdict needs is bound to locals
    here before the untrusted code runs, so patching modules cannot reach it."""
    write, exit_, exec_, compile_ = os.write, os._exit, exec, compile
    try:
        os.setsid()
        stdin_path = job.get("stdin_path")
        in_fd = os.open(stdin_path or os.devnull, os.O_RDONLY)
        for src, dst in ((in_fd, 0), (out_fd, 1), (err_fd, 2)):
            os.dup2(src, dst)
        os.closerange(3, res_fd)
        os.closerange(res_fd + 1, 65536)
        if stdin_path:
            os.unlink(stdin_path)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
        stdout = sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="replace"
        )
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="replace")
        os.environ.clear()
        os.environ.update({"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"})
        tempfile.tempdir = workdir
        sys.dont_write_bytecode = True
        sys.path[:] = [p for p in sys.path if p and any(p.startswith(r) for r in roots)]
        limit_s, mem = float(job["timeout"]), int(job["memory_mb"]) << 20
        cpu = int(limit_s) + 1
        rl = resource.setrlimit
        rl(resource.RLIMIT_CPU, (cpu, cpu + 1))
        rl(resource.RLIMIT_AS, (mem, mem))
        rl(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        rl(resource.RLIMIT_NOFILE, (256, 256))
        rl(resource.RLIMIT_CORE, (0, 0))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-big write raises OSError instead of killing
        # A private size-capped tmpfs over the working dir: disk use is bounded and freed with the process.
        if _libc.unshare(_CLONE_NEWNS) == 0:
            _libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None)
            opts = f"size={WORKDIR_MB}m,mode=0700" + (
                f",uid={SANDBOX_UID},gid={SANDBOX_UID}" if job.get("drop_uid") else ""
            )
            _libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode())
        os.chdir(workdir)
        if job.get("drop_uid"):
            rl(resource.RLIMIT_NPROC, (64, 64))
            os.setgroups([])
            os.setresgid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
            os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
        elif os.geteuid() == 0:
            _drop_capabilities()  # root that cannot drop its uid still sheds every capability
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        if os.getppid() == 1:
            exit_(3)
        _landlock(roots, workdir, ["/dev/null", "/dev/urandom", "/dev/zero"])
        gc_callbacks, thread_count, mproxy = (
            gc.callbacks,
            __import__("_thread")._count,
            types.MappingProxyType,
        )
        stdio = job["mode"] == "stdio"
        stage = "compile"
        sol = compile_(job["code"], "<solution>", "exec")
        stage = "tests-compile"
        tst = None if stdio else compile_(job["tests"], "<tests>", "exec")
        if job.get("audit_hook", True):  # off only in tests that check the kernel layers alone
            sys.addaudithook(_make_audit_hook(workdir, roots))
    except BaseException as e:  # noqa: BLE001 - the verdict needs every failure reported
        _report(write, res_fd, locals().get("stage", "setup"), e)
        exit_(3)
    ns = {"__name__": "__main__", "__builtins__": dict(_BUILTINS)}
    stage = "solution"
    try:
        exec_(sol, ns)
        if not stdio:
            stage = "tests"
            # Tests get their own globals and fresh builtins: a solution function called from a test
            # cannot rebind `check`, `abs` or `len` behind the test's back.
            for t in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF):
                signal.setitimer(t, 0)
            for sig in range(1, signal.NSIG):
                if sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGXFSZ):
                    with contextlib.suppress(OSError, ValueError, RuntimeError):
                        signal.signal(sig, signal.SIG_DFL)
            gc_callbacks.clear()
            if thread_count() > 0:
                raise RuntimeError("the solution left threads running")
            _restore_modules()
            tns = dict(ns)
            tns["__builtins__"] = dict(_BUILTINS)  # unreachable from the solution (no frames, no gc)
            exec_(tst, tns)
    except SystemExit as e:
        if not (stdio and e.code in (None, 0)):
            _report(write, res_fd, stage, e)
            exit_(1)
    except BaseException as e:  # noqa: BLE001
        _report(write, res_fd, stage, e)
        exit_(1)
    with contextlib.suppress(BaseException):
        stdout.flush()
        sys.stdout.flush()
    write(res_fd, b"\nOK" + nonce + b"\n")
    exit_(0)


def _report(write, fd: int, stage: str, e: BaseException) -> None:
    with contextlib.suppress(BaseException):
        tb, line = e.__traceback__, getattr(e, "lineno", 0) or 0
        while tb is not None:
            line, tb = tb.tb_lineno, tb.tb_next
        msg = {"stage": stage, "type": type(e).__name__, "msg": str(e)[:500], "line": line}
        write(fd, b"\nE" + json.dumps(msg).encode() + b"\n")


# --------------------------------------------------------------------------------------------------
# The supervisor: forks one child per program and judges it


def _supervise_one(job: dict, roots: list[str]) -> SandboxResult:
    t0 = time.monotonic()
    job = dict(job, drop_uid=_SUPERVISOR.get("drop_uid", False))
    workdir = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=_SUPERVISOR.get("tmp"))
    pid = -1
    try:
        if job.get("drop_uid"):
            os.chown(workdir, SANDBOX_UID, SANDBOX_UID)
        if job.get("stdin") is not None:
            job = dict(job, stdin_path=os.path.join(workdir, ".stdin"))
            with open(job["stdin_path"], "w", encoding="utf-8") as f:
                f.write(job["stdin"])
        nonce = secrets.token_bytes(32)
        res_r, res_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            try:
                for fd in (res_r, out_r, err_r):
                    os.close(fd)
                _child(job, nonce, res_w, out_w, err_w, workdir, roots)
            finally:
                os._exit(4)
        for fd in (res_w, out_w, err_w):
            os.close(fd)
        bufs, totals = {out_r: bytearray(), err_r: bytearray(), res_r: bytearray()}, collections.Counter()
        exit_status, timed_out, flooded = _collect(pid, bufs, totals, t0 + float(job["timeout"]))
    finally:
        if pid > 0:
            _kill_group(pid)
        shutil.rmtree(workdir, ignore_errors=True)
    for fd in bufs:
        os.close(fd)
    return _judge(job, nonce, bufs, exit_status, timed_out, flooded, time.monotonic() - t0)


def _collect(pid: int, bufs: dict, totals, deadline: float):
    sel = selectors.DefaultSelector()
    pidfd = os.pidfd_open(pid)
    sel.register(pidfd, selectors.EVENT_READ)
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    open_fds, exit_status, timed_out, flooded = set(bufs), None, False, False
    try:
        while open_fds or exit_status is None:
            left = deadline - time.monotonic()
            if exit_status is not None:
                left = min(left, 0.05)  # child gone; only escaped holders keep pipes open
            if left <= 0:
                if exit_status is None:
                    timed_out = True
                break
            for key, _ in sel.select(left):
                fd = key.fd
                if fd == pidfd:
                    exit_status = os.waitpid(pid, 0)[1]
                    sel.unregister(pidfd)
                    continue
                data = os.read(fd, 65536)
                if not data:
                    sel.unregister(fd)
                    open_fds.discard(fd)
                    continue
                totals[fd] += len(data)
                if len(bufs[fd]) < OUTPUT_CAP:
                    bufs[fd] += data[: OUTPUT_CAP - len(bufs[fd])]
                if totals[fd] > OUTPUT_HARD_LIMIT:
                    flooded = True
                    os.killpg(pid, signal.SIGKILL)
    finally:
        sel.close()
        os.close(pidfd)
    if exit_status is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        exit_status = os.waitpid(pid, 0)[1]
    return exit_status, timed_out, flooded


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    _reap_strays()


def _reap_strays() -> None:
    """Kill descendants that escaped the group (we are their subreaper) and reap zombies."""
    try:
        # Cheap common case: no child left at all (orphaned descendants would be ours: subreaper).
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass
    except ChildProcessError:
        return
    me = str(os.getpid())
    for _ in range(3):
        strays = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        stat = f.read().rsplit(b")", 1)[1].split()
                except OSError:
                    continue
                if stat[1].decode() == me:
                    strays.append(int(entry))
        for p in strays:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not strays:
            return
        time.sleep(0.01)


def _judge(job, nonce, bufs, exit_status, timed_out, flooded, seconds) -> SandboxResult:
    out_r, err_r, res_r = list(bufs)
    stdout = bytes(bufs[out_r]).decode("utf-8", "replace")
    stderr = bytes(bufs[err_r]).decode("utf-8", "replace")
    res = bytes(bufs[res_r])
    # The nonce is judged only at the very end of the result pipe, where the harness writes it.
    ok = res.endswith(b"\nOK" + nonce + b"\n")
    err = {}
    for line in res.split(b"\n"):
        if line.startswith(b"E{"):
            with contextlib.suppress(ValueError):
                err = json.loads(line[1:])
    sig = os.WTERMSIG(exit_status) if os.WIFSIGNALED(exit_status) else 0
    code = os.WEXITSTATUS(exit_status) if os.WIFEXITED(exit_status) else -1

    def result(status: str, detail: str) -> SandboxResult:
        return SandboxResult(status, status == "passed", stdout, stderr, round(seconds, 4), detail)

    if timed_out or sig == signal.SIGXCPU:
        return result("timeout", f"over the {job['timeout']}s limit")
    if flooded:
        return result("failed", f"output over {OUTPUT_HARD_LIMIT} bytes")
    if err.get("type") == "MemoryError":
        return result("memory", f"MemoryError in {err.get('stage')}")
    if err.get("stage") == "compile" and err.get("type") in ("SyntaxError", "IndentationError", "TabError"):
        return result("syntax_error", f"{err['type']}: {err.get('msg')} (line {err.get('line')})")
    if sig:
        status = (
            "memory"
            if sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT) and "Memory" in stderr
            else "crashed"
        )
        return result(status, f"killed by signal {signal.Signals(sig).name}")
    if ok and code == 0:
        if job["mode"] == "stdio" and not outputs_match(stdout, job.get("expect") or ""):
            return result("failed", "wrong output")
        return result("passed", "")
    if err:
        kind = "crashed" if err.get("stage") in ("setup", "tests-compile") else "failed"
        return result(
            kind, f"{err.get('stage')}: {err.get('type')}: {err.get('msg')} (line {err.get('line')})"
        )
    return result("failed", f"exited with code {code} before the tests completed")


def _expand(job: dict, roots: list[str]) -> SandboxResult:
    """Run one job; stdio test lists run one sandboxed program per case, stopping at the first failure."""
    if job["tests"].startswith(STDIO_MARKER):
        try:
            cases = json.loads(job["tests"][len(STDIO_MARKER) :])
        except ValueError as e:
            return SandboxResult("crashed", False, detail=f"bad stdio tests: {e}")
        if not cases:
            return SandboxResult("crashed", False, detail="no test cases")
        total, r = 0.0, None
        for stdin, expect in cases:
            r = _supervise_one(dict(job, mode="stdio", stdin=stdin, expect=expect), roots)
            total += r.seconds
            if not r.passed:
                break
        return SandboxResult(r.status, r.passed, r.stdout, r.stderr, round(total, 4), r.detail)
    mode = "stdio" if job.get("expect") is not None else "asserts"
    return _supervise_one(dict(job, mode=mode), roots)


def _others_can_read(roots: list[str]) -> bool:
    """True if uid SANDBOX_UID can reach and read every root (e.g. not a Python under /root)."""
    for root in roots:
        parts = root.split("/")
        for i in range(2, len(parts) + 1):
            try:
                mode = os.stat("/".join(parts[:i]) or "/").st_mode
            except OSError:
                return False
            if mode & 0o005 != 0o005:
                return False
    return True


_SUPERVISOR: dict = {}


def _prepare_supervisor() -> dict:
    """Set up this (single-threaded) supervising process once: no network for it and its children,
    subreaper for escaped descendants, no secrets in its environment."""
    roots = _read_roots()
    info = {"netns": _unshare_network(), "landlock_abi": _LL_ABI, "root": os.geteuid() == 0}
    # Dropping to "nobody" is only possible when nobody can still read the Python install.
    info["drop_uid"] = info["root"] and _others_can_read(roots)
    # /dev/shm makes the per-program mkdir/rmdir ~100x cheaper than a disk-backed /tmp.
    shm = "/dev/shm"
    tmp = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
    _SUPERVISOR.update(info, roots=roots, tmp=tmp)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    for k in list(os.environ):
        if k not in ("PATH", "LANG", "LC_ALL", "TMPDIR"):
            del os.environ[k]
    return info


def _serve() -> None:
    """Worker loop: length-prefixed JSON jobs on stdin, results on stdout."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # stray prints must never corrupt the protocol
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    info = _prepare_supervisor()
    roots = _SUPERVISOR["roots"]
    rin, wout = os.fdopen(proto_in, "rb"), os.fdopen(proto_out, "wb")
    _send(wout, info)
    while True:
        job = _recv(rin)
        if job is None:
            return
        try:
            result = _expand(job, roots).to_dict()
        except Exception as e:  # noqa: BLE001 - a supervisor bug must not kill the worker
            result = SandboxResult("crashed", False, detail=f"supervisor error: {e!r}").to_dict()
        _send(wout, result)


def _send(f, obj) -> None:
    data = json.dumps(obj).encode()
    f.write(struct.pack("<I", len(data)) + data)
    f.flush()


def _recv(f):
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    data = f.read(n)
    return json.loads(data) if len(data) == n else None


# --------------------------------------------------------------------------------------------------
# The pool: long-lived workers in the caller's process tree, a verdict cache


class _Worker:
    def __init__(self):
        import subprocess

        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        boot = (
            f"import sys; sys.path.insert(0, {pkg_parent!r}); from marlflow.sandbox import _serve; _serve()"
        )
        env = {k: os.environ[k] for k in ("PATH", "LANG", "TMPDIR") if k in os.environ}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            start_new_session=True, close_fds=True,
        )  # fmt: skip
        self.info = self._read(60.0)
        if self.info is None:
            self.close()
            raise RuntimeError("sandbox worker failed to start")

    def _read(self, timeout: float):
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                return None
        finally:
            sel.close()
        return _recv(self.proc.stdout)

    def run(self, job: dict) -> dict | None:
        try:
            _send(self.proc.stdin, job)
        except (BrokenPipeError, OSError):
            return None
        n_cases = 1
        if job["tests"].startswith(STDIO_MARKER):
            with contextlib.suppress(ValueError):
                n_cases = max(1, len(json.loads(job["tests"][len(STDIO_MARKER) :])))
        return self._read(float(job["timeout"]) * n_cases + 30.0)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
            self.proc.stdout.close()
        self.proc.wait()


class SandboxPool:
    """`max_workers` long-lived sandbox workers; each forks a fresh child per program.
    A worker that dies (or hangs) is replaced. Use as a context manager or call `close()`."""

    def __init__(self, max_workers: int | None = None):
        self.max_workers = max(1, max_workers or os.cpu_count() or 1)
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._exec = ThreadPoolExecutor(self.max_workers, thread_name_prefix="sandbox")
        self._closed = False

    def _acquire(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if len(self._all) < self.max_workers:
                w = _Worker()
                self._all.append(w)
                return w
        return self._idle.get()

    def start(self) -> SandboxPool:
        """Start all workers now (otherwise they start on first use)."""
        with self._lock:
            while len(self._all) < self.max_workers:
                w = _Worker()
                self._all.append(w)
                self._idle.put(w)
        return self

    def _retire(self, w: _Worker) -> None:
        w.close()
        with self._lock:
            self._all.remove(w)

    def run(self, job: dict) -> SandboxResult:
        w = self._acquire()
        out = w.run(job)
        if out is None:
            self._retire(w)
            return SandboxResult("crashed", False, detail="sandbox worker died or hung; replaced")
        self._idle.put(w)
        return SandboxResult(**out)

    def map(self, jobs: list[dict]) -> list[SandboxResult]:
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        return list(self._exec.map(self.run, jobs))

    def close(self) -> None:
        self._closed = True
        self._exec.shutdown(wait=True)
        with self._lock:
            for w in self._all:
                w.close()
            self._all.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_POOLS: dict[int, SandboxPool] = {}
_POOLS_LOCK = threading.Lock()
_CACHE: collections.OrderedDict[str, SandboxResult] = collections.OrderedDict()
_CACHE_LOCK = threading.Lock()


def _pool(max_workers: int | None) -> SandboxPool:
    n = max(1, max_workers or os.cpu_count() or 1)
    with _POOLS_LOCK:
        if n not in _POOLS:
            _POOLS[n] = SandboxPool(n)
        return _POOLS[n]


@atexit.register
def shutdown() -> None:
    """Stop the shared pools (also runs at interpreter exit)."""
    with _POOLS_LOCK:
        for p in _POOLS.values():
            p.close()
        _POOLS.clear()


def clear_cache() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()


def _as_job(job, timeout: float, memory_mb: int) -> dict:
    if isinstance(job, dict):
        d = dict(job)
    else:
        t = tuple(job)
        if len(t) not in (2, 4):
            raise ValueError("a job is (code, tests) or (code, tests, stdin, expect)")
        d = dict(zip(("code", "tests", "stdin", "expect"), t))
    d.setdefault("tests", "")
    d.setdefault("stdin", None)
    d.setdefault("expect", None)
    d.setdefault("timeout", timeout)
    d.setdefault("memory_mb", memory_mb)
    if not isinstance(d.get("code"), str) or not isinstance(d["tests"], str):
        raise TypeError("job code and tests must be str")
    return d


def verify_many(
    jobs, timeout: float = 5.0, memory_mb: int = 1024, max_workers: int | None = None, cache: bool = True
) -> list[SandboxResult]:
    """Verify jobs in parallel in the shared pool. A job is (code, tests) or (code, tests, stdin, expect)
    or a dict with those keys (and optional timeout, memory_mb). Results come back in job order;
    identical jobs are verified once and verdicts are cached (except worker crashes)."""
    norm = [_as_job(j, timeout, memory_mb) for j in jobs]
    keys = [
        hashlib.sha256(json.dumps([j[k] for k in ("code", "tests", "stdin", "expect", "timeout", "memory_mb")]).encode()).hexdigest()
        for j in norm
    ]  # fmt: skip
    results: dict[str, SandboxResult] = {}
    if cache:
        with _CACHE_LOCK:
            for k in keys:
                if k in _CACHE:
                    _CACHE.move_to_end(k)
                    results[k] = _CACHE[k]
    todo = {k: j for k, j in zip(keys, norm) if k not in results}
    if todo:
        fresh = _pool(max_workers).map(list(todo.values()))
        for k, r in zip(todo, fresh):
            results[k] = r
            if cache and not (r.status == "crashed" and "worker" in r.detail):
                with _CACHE_LOCK:
                    _CACHE[k] = r
                    while len(_CACHE) > _CACHE_SIZE:
                        _CACHE.popitem(last=False)
    return [results[k] for k in keys]


def verify(code: str, tests: str, stdin: str | None = None, expect: str | None = None, **kw) -> SandboxResult:
    """One job through `verify_many`."""
    job = (code, tests) if stdin is None and expect is None else (code, tests, stdin or "", expect or "")
    return verify_many([job], **kw)[0]


def run_local(code: str, tests: str, stdin=None, expect=None, timeout=5.0, memory_mb=1024) -> SandboxResult:
    """Run one job by forking from *this* process (what the command line does). Call it only from a
    single-threaded process with nothing secret in memory; the trainer should use `verify_many`."""
    _prepare_supervisor()
    job = _as_job((code, tests, stdin, expect), timeout, memory_mb)
    return _expand(job, _SUPERVISOR["roots"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m marlflow.sandbox", description=__doc__.split("\n")[0])
    ap.add_argument("--code", required=True, help="file with the untrusted solution")
    ap.add_argument("--tests", required=True, help="file with Python test code run after the solution")
    ap.add_argument("--stdin", help="file fed to the program's stdin")
    ap.add_argument("--expect", help="file with the expected stdout (whitespace-insensitive)")
    ap.add_argument("--timeout", type=float, default=5.0, help="wall-clock seconds (default 5)")
    ap.add_argument("--memory-mb", type=int, default=1024, help="address-space limit in MiB (default 1024)")
    a = ap.parse_args(argv)

    def read(p):
        with open(p, encoding="utf-8") as f:
            return f.read()

    stdin = read(a.stdin) if a.stdin else (None if a.expect is None else "")
    expect = read(a.expect) if a.expect else None
    r = run_local(read(a.code), read(a.tests), stdin, expect, a.timeout, a.memory_mb)
    sys.stdout.write(json.dumps(r.to_dict()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
