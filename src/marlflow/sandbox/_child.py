"""The two forked children: the candidate (untrusted code, sandboxed) and the judge (trusted test code).

The candidate process never holds anything the verdict depends on: it gets the program, the arguments
of the calls to make (or a stdin), and writes back return values in the strict encoding of `_result`.
Expected values and expected stdout stay with the caller of the pool; test code that could not be
turned into (call, expected) pairs runs in the judge process, forked after the candidate (so the
candidate's memory never held it), which calls the candidate's functions over a pipe.

Result-pipe records, one per line: before the `S` line only the harness has run, so an `E` record there
(setup or compile error) is trusted; everything after `S` may have been written by the program and is
only ever read as data (`R` return value, `X` exception in a call, `E` exception, `Y` ready, `Z` done).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import resource
import signal
import sys
import tempfile

from marlflow.sandbox._guard import (
    _BUILTINS,
    make_audit_hook,
    neuter_private_modules,
    restore_modules,
)
from marlflow.sandbox._kernel import (
    _CLONE_NEWNS,
    _MS_NODEV,
    _MS_NOEXEC,
    _MS_NOSUID,
    _MS_PRIVATE,
    _MS_REC,
    _PR_SET_PDEATHSIG,
    _drop_capabilities,
    _landlock,
    _libc,
    _prctl,
    _seccomp,
)
from marlflow.sandbox._result import RESULT_LIMIT, SANDBOX_UID, WORKDIR_MB, from_wire, to_wire


def _close_fds_except(keep: set[int]) -> None:
    lo = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, 65536)


def _limits(timeout: float, memory_mb: int) -> None:
    cpu = int(timeout) + 1
    rl = resource.setrlimit
    rl(resource.RLIMIT_CPU, (cpu, cpu + 1))
    rl(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    rl(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    rl(resource.RLIMIT_NOFILE, (256, 256))
    rl(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-big write raises OSError instead of killing


def _record(write, fd: int, tag: bytes, e: BaseException, stage: str) -> None:
    with contextlib.suppress(BaseException):
        tb, line = e.__traceback__, getattr(e, "lineno", 0) or 0
        while tb is not None and not isinstance(e, SyntaxError):
            line, tb = tb.tb_lineno, tb.tb_next
        msg = {"stage": stage, "type": type(e).__name__, "msg": str(e)[:500], "line": line,
               "errno": getattr(e, "errno", None) if isinstance(getattr(e, "errno", None), int) else None}  # fmt: skip
        write(fd, tag + json.dumps(msg).encode() + b"\n")


def _resolve(ns: dict, fn: str):
    # LeetCode-style problems define `class Solution` with the function as a method.
    sol = ns.get("Solution")
    if fn not in ns and isinstance(sol, type) and hasattr(sol, fn):
        return getattr(sol(), fn)
    return ns[fn]


def _parent_gone(alive_fd) -> bool:
    """Did the supervisor die before PDEATHSIG was armed? (A readable pidfd means it exited.)"""
    if alive_fd is None:
        return os.getppid() == 1
    import select

    return bool(select.select([alive_fd], [], [], 0)[0])


def candidate(job: dict, fds: dict, workdir: str, roots: list[str]):
    """Runs in the forked child; never returns. Where the supervisor built a view (`job["base"]`), the
    child chroots into it and `workdir` (a path in the supervisor's view) becomes `inside`."""
    write, exit_, exec_, compile_ = os.write, os._exit, exec, compile
    res = fds["res"]
    stage = "setup"
    base, layers, alive_fd = job.get("base"), job.get("layers") or {}, job.get("alive_fd")
    inside = workdir[len(base) :] if base else workdir
    try:
        os.setsid()
        stdin_path = job.get("stdin_path")
        in_fd = os.open(stdin_path or os.devnull, os.O_RDONLY)
        for src, dst in ((in_fd, 0), (fds["out"], 1), (fds["err"], 2)):
            os.dup2(src, dst)
        keep = {res, fds.get("req", -1), fds.get("resp", -1), alive_fd if alive_fd is not None else -1}
        _close_fds_except(keep)
        if stdin_path:
            os.unlink(stdin_path)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
        stdout = sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="replace"
        )
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="replace")
        os.environ.clear()
        os.environ.update({"PATH": "/usr/bin:/bin", "HOME": inside, "TMPDIR": inside, "LANG": "C.UTF-8"})
        tempfile.tempdir = inside
        sys.dont_write_bytecode = True
        sys.path[:] = [p for p in sys.path if p and any(p.startswith(r) for r in roots)]
        _limits(job["timeout"], job["memory_mb"])
        # A private, size-capped, non-executable tmpfs over the working dir: disk use is bounded and freed
        # with the process, and nothing written there can be mapped executable (no extension module, no
        # shared object). With the PID namespace the child already has its own mount namespace.
        if layers.get("pidns") or _libc.unshare(_CLONE_NEWNS) == 0:
            if not base:
                _libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None)
            opts = f"size={WORKDIR_MB}m,mode=0700" + (
                f",uid={SANDBOX_UID},gid={SANDBOX_UID}" if job.get("drop_uid") else ""
            )
            flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
            if _libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", flags, opts.encode()) != 0 and base:
                raise OSError("cannot mount the working directory's tmpfs")
        if base:
            os.chroot(base)  # the view: the Python install (read-only), three devices, the working dir
        os.chdir(inside)
        if job.get("drop_uid"):
            resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
            os.setgroups([])
            os.setresgid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
            os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
        # Root that cannot drop its uid, and an unprivileged supervisor's child (which holds every
        # capability of the supervisor's user namespace), shed them all.
        _drop_capabilities()
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        if _parent_gone(alive_fd):
            exit_(3)
        if alive_fd is not None:
            os.close(alive_fd)
        _landlock(roots, inside, ["/dev/null", "/dev/urandom", "/dev/zero"])
        if not _seccomp() and layers.get("seccomp"):
            raise OSError("the kernel refused the seccomp filter")
        mode = job["mode"]
        stage = "compile"
        sol = compile_(job["code"], "<solution>", "exec")
        stage = "setup-compile"
        setup = compile_(job["setup"], "<setup>", "exec") if job.get("setup") else None
        stage = "setup"
        neuter_private_modules()
        if job.get("audit_hook", True):  # off only in tests that check the kernel layers alone
            sys.addaudithook(make_audit_hook(inside, roots))
    except BaseException as e:  # noqa: BLE001 - the verdict needs every failure reported
        _record(write, res, b"E", e, stage)
        exit_(3)
    write(res, b"S\n")  # from here on, the program may write anything to any fd it holds
    ns = {"__name__": "__main__", "__builtins__": dict(_BUILTINS)}
    stage = "solution"
    try:
        exec_(sol, ns)
        if setup is not None:
            stage = "setup"
            exec_(setup, ns)
    except SystemExit as e:
        if not (mode == "stdio" and e.code in (None, 0)):
            _record(write, res, b"E", e, stage)
            exit_(1)
    except BaseException as e:  # noqa: BLE001
        _record(write, res, b"E", e, stage)
        exit_(1)
    with contextlib.suppress(BaseException):
        stdout.flush()
    if mode == "stdio":
        exit_(0)
    restore_modules()
    if mode == "calls":
        for fn, args, kwargs in job["calls"]:
            write(res, b"R" + _call(ns, fn, args, kwargs) + b"\n")
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
        write(res, b"Z\n")
        exit_(0)
    write(res, b"Y\n")
    reader = os.fdopen(fds["req"], "rb")
    while True:
        try:
            line = reader.readline()
        except BaseException:  # noqa: BLE001
            exit_(1)
        if not line:
            exit_(0)
        try:
            fn, args, kwargs = json.loads(line)
        except BaseException:  # noqa: BLE001
            exit_(1)
        out = _call(ns, fn, args, kwargs) + b"\n"
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
        try:
            view = memoryview(out)
            while view:
                view = view[write(fds["resp"], view) :]
        except BaseException:  # noqa: BLE001
            exit_(1)


def _call(ns: dict, fn: str, args, kwargs) -> bytes:
    """One call of the program's function, answered as ["ok", value] or ["err", {type, msg, errno}]."""
    try:
        f = _resolve(ns, fn)
        a, k = from_wire(args, refs=ns), from_wire(kwargs, refs=ns)
        out = json.dumps(["ok", to_wire(f(*a, **k))], separators=(",", ":")).encode()
        if len(out) > RESULT_LIMIT:
            raise ValueError(f"return value over {RESULT_LIMIT} bytes encoded")
        return out
    except BaseException as e:  # noqa: BLE001 - an exception is the call's answer
        errno = getattr(e, "errno", None)
        info = {
            "type": type(e).__name__,
            "msg": str(e)[:300],
            "errno": errno if isinstance(errno, int) else None,
        }
        try:
            return json.dumps(["err", info]).encode()
        except BaseException:  # noqa: BLE001
            return b'["err",{"type":"Error","msg":"","errno":null}]'


# ------------------------------------------------------------------------------------------- the judge


class CandidateError(Exception):
    """The candidate's function raised, returned a value outside the strict encoding, or is gone."""

    def __init__(self, info: dict):
        super().__init__(f"{info.get('type')}: {info.get('msg')}")
        self.info = info


def _free_names(tree: ast.AST) -> set[str]:
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound


def judge(job: dict, fds: dict, roots: list[str]):
    """Runs the trusted test code in its own forked process; never returns. `PASS` on the verdict pipe,
    which only this process holds, is the only way a judged job passes."""
    write, exit_ = os.write, os._exit
    verdict = fds["verdict"]
    stage = "judge-setup"
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for dst in (0, 1, 2):
            os.dup2(null, dst)
        _close_fds_except({verdict, fds["req"], fds["resp"]})
        sys.stdout = sys.stderr = io.StringIO()
        _limits(job["timeout"], max(job["memory_mb"], 512))
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:
            exit_(3)
        _landlock(roots, None, ["/dev/null", "/dev/urandom"])
        stage = "tests-compile"
        tree = ast.parse(job["tests"], "<tests>")
        code = compile(tree, "<tests>", "exec")
        ns: dict = {"__name__": "__main__", "__builtins__": dict(_BUILTINS)}
        stage = "prelude"
        if job.get("prelude"):
            exec(job["prelude"], ns)
        names = (_free_names(tree) - set(_BUILTINS) - set(ns)) | set(job.get("proxies") or ())
        req = os.fdopen(fds["req"], "wb", buffering=0)
        resp = os.fdopen(fds["resp"], "rb")
        for name in names:
            # The tests once ran in the program's globals and may use a module only the program imported.
            if name in sys.stdlib_module_names and name not in (job.get("proxies") or ()):
                with contextlib.suppress(ImportError):
                    ns[name] = __import__(name)
                    continue
            ns[name] = _proxy(name, req, resp)
        stage = "tests"
        exec(code, ns)
    except BaseException as e:  # noqa: BLE001
        info = getattr(e, "info", None)
        _record(write, verdict, b"E", e, "candidate" if info is not None else stage)
        if info is not None:
            write(verdict, b"C" + json.dumps(info).encode() + b"\n")
        exit_(1)
    write(verdict, b"PASS\n")
    exit_(0)


def _proxy(name: str, req, resp):
    def call(*args, **kwargs):
        try:
            msg = json.dumps([name, to_wire(list(args)), to_wire(kwargs)], separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise CandidateError(
                {"type": "ArgumentError", "msg": f"cannot send arguments to {name}: {e}"}
            ) from None
        try:
            req.write(msg.encode() + b"\n")
            line = resp.readline(RESULT_LIMIT + 64)
        except OSError:
            line = b""
        if not line.endswith(b"\n"):
            raise CandidateError({"type": "Exited", "msg": f"the program did not answer a call of {name}"})
        try:
            kind, value = json.loads(line)
            if kind == "ok":
                return from_wire(value)
            info = dict(value) if kind == "err" and isinstance(value, dict) else {"type": "Malformed"}
        except (ValueError, TypeError, RecursionError):
            info = {"type": "Malformed", "msg": "the program's answer is not a plain builtin value"}
        raise CandidateError({k: info.get(k) for k in ("type", "msg", "errno")})

    call.__name__ = call.__qualname__ = name
    return call
