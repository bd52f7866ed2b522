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
import random
import resource
import signal
import sys
import tempfile
import types

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
from marlflow.sandbox._result import (
    RESULT_LIMIT,
    SANDBOX_UID,
    WORKDIR_MB,
    WRAPPER_NAMES,
    Shared,
    _hashable,
    from_wire,
    module_names,
    parse_record,
    to_wire,
)


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


def _own_stdio(job: dict, fds: dict, inside: str, roots: list[str], alive_fd) -> io.TextIOWrapper:
    """The first setup steps of `candidate`: a session of its own, stdin from the job's file (deleted once
    open) or /dev/null, stdout and stderr on the job's pipes, every other fd closed but the result,
    request, response and supervisor-alive fds, a scrubbed environment, and `sys.path` limited to the
    read roots. Returns the new `sys.stdout`."""
    os.setsid()
    stdin_path = job.get("stdin_path")
    in_fd = os.open(stdin_path or os.devnull, os.O_RDONLY)
    for src, dst in ((in_fd, 0), (fds["out"], 1), (fds["err"], 2)):
        os.dup2(src, dst)
    _close_fds_except(
        {fds["res"], fds.get("req", -1), fds.get("resp", -1), alive_fd if alive_fd is not None else -1}
    )
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
    return stdout


def _confine(job: dict, workdir: str, inside: str, roots: list[str], exit_) -> None:
    """The kernel layers of `candidate`, in an order that matters (see docs/sandbox.md): rlimits, the
    working dir's tmpfs and the chroot into the view (both need the privileges given up next), uid and
    gid drop, every capability dropped, PDEATHSIG (cleared by setuid; then exit 3 if the supervisor is
    already gone), Landlock, and seccomp last (it refuses mount and chroot). Raises OSError where the
    view's tmpfs or a seccomp filter the supervisor counted on (`job["base"]`, `job["layers"]`) is refused."""
    base, layers, alive_fd = job.get("base"), job.get("layers") or {}, job.get("alive_fd")
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


def candidate(job: dict, fds: dict, workdir: str, roots: list[str]):
    """Runs in the forked child; never returns. Where the supervisor built a view (`job["base"]`), the
    child chroots into it and `workdir` (a path in the supervisor's view) becomes `inside`. The program is
    compiled, run and called from this frame, not a helper: frames below it count against its recursion
    limit (and the compiler's nesting limit in Python 3.11); the setup helpers return before it runs."""
    write, exit_, exec_, compile_ = os.write, os._exit, exec, compile
    res = fds["res"]
    stage = "setup"
    base = job.get("base")
    inside = workdir[len(base) :] if base else workdir
    try:
        stdout = _own_stdio(job, fds, inside, roots, job.get("alive_fd"))
        _confine(job, workdir, inside, roots, exit_)
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
    # The worker imported `random` once; without a fresh seed every program it forks would draw the
    # same numbers, and a program right by chance would be right (or wrong) every time.
    with contextlib.suppress(Exception):
        random.seed()
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
        for fn, args, kwargs, *wrappers in job["calls"]:
            write(res, b"R" + _call(ns, fn, args, kwargs, wrappers[0] if wrappers else ()) + b"\n")
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
        out = _call(ns, fn, args, kwargs, shared=True) + b"\n"
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
        try:
            view = memoryview(out)
            while view:
                view = view[write(fds["resp"], view) :]
        except BaseException:  # noqa: BLE001
            exit_(1)


def _call(ns: dict, fn: str, args, kwargs, wrappers=(), shared: bool = False) -> bytes:
    """One call of the program's function, answered as ["ok", value] or ["err", {type, msg, errno}].
    `wrappers` ([name, args, kwargs] of builtins in WRAPPER_NAMES, innermost first) are applied here, to
    the real return value under this process's limits. `shared` (the judge's calls): arguments and answer
    share one `Shared` numbering, and the answer carries the arguments' contents after the call as a
    third element, so the judge sees mutation and identity as plain Python would."""
    nodes: list = []
    try:
        f = _resolve(ns, fn)
        a = from_wire(args, refs=ns, nodes=nodes if shared else None)
        k = from_wire(kwargs, refs=ns, nodes=nodes if shared else None)
        out = f(*a, **k)
        for name, extra, kw in wrappers:
            if name not in WRAPPER_NAMES:
                raise ValueError(f"not a wrapper: {name}")
            out = _BUILTINS[name](out, *from_wire(extra), **from_wire(kw))
        tag, value = "ok", out
    except BaseException as e:  # noqa: BLE001 - an exception is the call's answer
        errno = getattr(e, "errno", None)
        tag, value = "err", {"type": type(e).__name__, "msg": str(e)[:300] if _plain_str(e) else "",
                             "errno": errno if isinstance(errno, int) else None,
                             # the nearest builtin class: `except ValueError` catches json.JSONDecodeError
                             "base": next((c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"), "")}  # fmt: skip
    try:
        memo = Shared(nodes) if shared else None
        states = [_contents(n, memo) for n in nodes] if shared else None
        wire = to_wire(value, memo=memo) if tag == "ok" else value
        out = json.dumps([tag, wire] + ([states] if shared else []), separators=(",", ":")).encode()
        if len(out) > RESULT_LIMIT:
            raise ValueError(f"return value over {RESULT_LIMIT} bytes encoded")
        return out
    except BaseException as e:  # noqa: BLE001
        info = {"type": type(e).__name__, "msg": str(e)[:300] if _plain_str(e) else "", "errno": None}
        try:
            return json.dumps(["err", info]).encode()
        except BaseException:  # noqa: BLE001
            return b'["err",{"type":"Error","msg":"","errno":null}]'


def _plain_str(e: BaseException) -> bool:
    try:
        return type(str(e)) is str
    except BaseException:  # noqa: BLE001 - a message that cannot be printed is sent empty
        return False


def _contents(node, memo):
    """What a container argument holds now, for the judge to copy into its own object (see `_call`);
    None for tuples and frozensets, which cannot change."""
    t = type(node)
    if t is list:
        return [to_wire(x, 1, memo) for x in node]
    if t is dict:
        return [[to_wire(k, 1, memo), to_wire(x, 1, memo)] for k, x in dict.items(node)]
    if t is set:
        return [to_wire(x, 1, memo) for x in node]
    if t is bytearray:
        return node.hex()
    return None


def _update(node, state, nodes: list) -> None:
    """Inverse of `_contents`, in the judge: `node` (the judge's own argument) now holds what the
    program's copy holds, with containers it shares with other arguments resolved through `nodes`."""
    t = type(node)
    if state is None:
        return
    if t is list and type(state) is list:
        node[:] = [from_wire(x, 1, nodes=nodes) for x in state]
    elif (
        isinstance(node, dict) and type(state) is list and all(type(p) is list and len(p) == 2 for p in state)
    ):
        pairs = [(from_wire(k, 1, nodes=nodes), from_wire(x, 1, nodes=nodes)) for k, x in state]
        _hashable([k for k, _ in pairs], "dict key")
        node.clear()
        for k, x in pairs:  # item by item: Counter.update would add counts; OrderedDict keeps its order
            node[k] = x
    elif t is set and type(state) is list:
        items = _hashable([from_wire(x, 1, nodes=nodes) for x in state], "set item")
        node.clear()
        node.update(items)
    elif t is bytearray and type(state) is str:
        node[:] = bytes.fromhex(state)
    else:
        raise ValueError("malformed argument state")


# ------------------------------------------------------------------------------------------- the judge


class CandidateError(Exception):
    """The candidate's function raised an exception with no builtin type of that name, returned a value
    outside the strict encoding, or is gone. (An exception of a builtin type is raised as that type.)"""

    def __init__(self, info: dict):
        super().__init__(f"{info.get('type')}: {info.get('msg')}")
        self.info = info


_RAISED: dict = {}  # the exception a proxy last raised for the candidate, and its sanitized record


def _candidate_exception(info) -> BaseException:
    """The exception to raise in the tests for the candidate's error record `info` (untrusted): an
    exception of the builtin Exception type it names (so `except ValueError` / `pytest.raises(ValueError)`
    behave as in plain Python), else CandidateError (also for SystemExit and KeyboardInterrupt, which
    must not end the tests as if they had finished). The record is kept in `_RAISED` for the verdict."""
    info = info if isinstance(info, dict) else {}
    clean = {
        "type": str(info.get("type"))[:100] if isinstance(info.get("type"), str) else "Malformed",
        "msg": str(info.get("msg"))[:300] if isinstance(info.get("msg"), str) else "",
        "errno": info.get("errno")
        if type(info.get("errno")) is int and abs(info["errno"]) < 1 << 16
        else None,
    }
    # The nearest builtin class of the program's exception (itself for a ValueError; ValueError for a
    # json.JSONDecodeError or the program's own `class E(ValueError)`), as `except ValueError` sees it.
    base = info.get("base") if isinstance(info.get("base"), str) else clean["type"]
    cls = _BUILTINS.get(base[:100])
    exc: BaseException = CandidateError(clean)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
        with contextlib.suppress(Exception):  # some need more arguments (UnicodeDecodeError): CandidateError
            exc = cls(clean["errno"], clean["msg"]) if clean["errno"] is not None and issubclass(
                cls, OSError) else cls(clean["msg"])  # fmt: skip
    _RAISED.clear()
    _RAISED.update(exc=exc, info=clean)
    return exc


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
        # The tests' namespace is the __main__ module (as for a script), so unittest.main() finds their
        # TestCase classes; argv is the script's alone.
        main = types.ModuleType("__main__")
        ns: dict = main.__dict__
        ns["__builtins__"] = dict(_BUILTINS)
        sys.modules["__main__"], sys.argv = main, ["<tests>"]
        stage = "prelude"
        if job.get("prelude"):
            exec(job["prelude"], ns)
        # Names the tests load but do not define in their own module scope are the program's; a name the
        # tests (or the prelude) define stays theirs, whatever the program defines.
        loaded, bound = module_names(tree)
        names = (set(loaded) - bound - set(_BUILTINS) - set(ns)) | set(job.get("proxies") or ())
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
        # Tests that end with sys.exit(0) (unittest.main()) passed, as the script would on its own. (The
        # program's own SystemExit reaches the tests as CandidateError, never as SystemExit.)
        if not (stage == "tests" and type(e) is SystemExit and e.code in (None, 0)):
            info = _RAISED["info"] if _RAISED and _RAISED.get("exc") is e else None
            _record(write, verdict, b"E", e, "candidate" if info is not None else stage)
            if info is not None:
                write(verdict, b"C" + json.dumps(info).encode() + b"\n")
            exit_(1)
    write(verdict, b"PASS\n")
    exit_(0)


def _proxy(name: str, req, resp):
    def call(*args, **kwargs):
        memo = Shared()
        try:
            msg = json.dumps([name, to_wire(list(args), memo=memo), to_wire(kwargs, memo=memo)],
                             separators=(",", ":"))  # fmt: skip
        except (TypeError, ValueError) as e:
            raise _candidate_exception(
                {"type": "ArgumentError", "msg": f"cannot send arguments to {name}: {e}"}
            ) from None
        try:
            req.write(msg.encode() + b"\n")
            line = resp.readline(RESULT_LIMIT + 64)
        except OSError:
            line = b""
        if not line.endswith(b"\n"):
            raise _candidate_exception(
                {"type": "Exited", "msg": f"the program did not answer a call of {name}"}
            )
        try:
            kind, value, *states = parse_record(line.decode("utf-8", "replace"))
            if states:
                # The arguments as the program left them: copied into the tests' own objects, in place.
                nodes = list(memo.objs)
                if type(states[0]) is not list or len(states[0]) != len(nodes):
                    raise ValueError("malformed argument states")
                for node, state in zip(list(nodes), states[0]):
                    _update(node, state, nodes)
            if kind == "ok":
                return from_wire(value, nodes=nodes) if states else from_wire(value)
            info = value if kind == "err" else {"type": "Malformed"}
        except (ValueError, TypeError, RecursionError):
            info = {"type": "Malformed", "msg": "the program's answer is not a plain builtin value"}
        raise _candidate_exception(info)

    call.__name__ = call.__qualname__ = name
    return call
