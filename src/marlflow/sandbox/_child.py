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
import collections
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
    _ENCODING,
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
    _own_user_namespace,
    _prctl,
    _seccomp,
)
from marlflow.sandbox._result import (
    RESULT_LIMIT,
    SANDBOX_UID,
    TASKS,
    WORKDIR_INODES,
    WORKDIR_MB,
    WRAPPER_NAMES,
    Handles,
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
    try:
        rl(resource.RLIMIT_NOFILE, (256, 256))  # the same for every candidate, whatever the worker's
    except (ValueError, OSError):  # an unprivileged worker whose hard limit is lower (>= 64, checked)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        rl(resource.RLIMIT_NOFILE, (hard, hard))
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
        # nr_inodes: without it a job's empty files and extended attributes pin kernel memory past the
        # size limit (setxattr is refused by seccomp as well).
        uid = job.get("uid", SANDBOX_UID)
        opts = f"size={WORKDIR_MB}m,nr_inodes={WORKDIR_INODES},mode=0700" + (
            f",uid={uid},gid={uid}" if job.get("drop_uid") else ""
        )
        flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        if _libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", flags, opts.encode()) != 0 and base:
            raise OSError("cannot mount the working directory's tmpfs")
    if layers.get("pidns"):  # its own UTS namespace: a hostname of its own, not the host's
        _libc.sethostname(b"sandbox", 7)
    # Unprivileged, the caller's uid for every candidate: a user namespace of its own makes RLIMIT_NPROC
    # (set below, after it: the limit in force when it is made bounds the parent's count) count this
    # job's tasks only. Before the chroot (the kernel refuses a new user namespace in one), after the
    # mount and sethostname (which need the worker's namespace's capabilities).
    own_ns = bool(layers.get("userns")) and not job.get("drop_uid")
    if own_ns and not _own_user_namespace():
        raise OSError("the kernel refused the candidate's user namespace")
    if base:
        os.chroot(base)  # the view: the Python install (read-only), three devices, the working dir
    os.chdir(inside)
    if own_ns:
        hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        n = TASKS if hard == resource.RLIM_INFINITY else min(TASKS, hard)
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    if job.get("drop_uid"):
        # A uid of this worker's own (`_supervisor`): RLIMIT_NPROC counts the tasks of one uid host-wide,
        # so a shared uid would let one job's threads fail another's.
        uid = job.get("uid", SANDBOX_UID)
        resource.setrlimit(resource.RLIMIT_NPROC, (TASKS, TASKS))
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
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
    mirror = Shared(handles=Handles())  # as the judge's: containers shared with the tests; objects given
    while True:
        try:
            line = reader.readline()
        except BaseException:  # noqa: BLE001
            exit_(1)
        if not line:
            exit_(0)
        try:
            fn, args, kwargs, keep, pre = json.loads(line)
        except BaseException:  # noqa: BLE001
            exit_(1)
        out = _call(ns, fn, args, kwargs, shared=mirror, sync=(keep, pre)) + b"\n"
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
        try:
            view = memoryview(out)
            while view:
                view = view[write(fds["resp"], view) :]
        except BaseException:  # noqa: BLE001
            exit_(1)


def _call(ns: dict, fn: str, args, kwargs, wrappers=(), shared: Shared | None = None, sync=None) -> bytes:
    """One call of the program's function, answered as ["ok", value] or ["err", {type, msg, errno}].
    `wrappers` ([name, args, kwargs] of builtins in WRAPPER_NAMES, innermost first) are applied here, to
    the real return value under this process's limits. `shared` (the judge's calls): the mirror, every
    container that crossed in any call so far and the tests still hold, numbered as the judge numbers
    them (`_mirror_sync`): `sync` = (the numbers the judge keeps, their contents in the tests now) is
    applied first, arguments and answer use the same numbering, and the answer carries the contents of
    every mirrored container after the call, so the judge sees identity (across calls too), aliasing and
    mutation (of an argument the program kept from an earlier call too) as plain Python would."""
    nodes: list = shared.objs if shared is not None else []
    a = k = out = None
    try:
        f = _resolve(ns, fn) if type(fn) is str or shared is None else _target(shared.objs.handles, fn)
        if shared is not None:
            _mirror_apply(shared, *sync)
        a = from_wire(args, refs=ns, nodes=nodes if shared is not None else None)
        k = from_wire(kwargs, refs=ns, nodes=nodes if shared is not None else None)
        if shared is not None:
            _reindex(shared)
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
        # The program may have rebound a builtin or a module attribute during the call: the encoding
        # below uses them, so they are put back first (as before the first call).
        restore_modules(_ENCODING)
        memo = shared
        states = _mirror_states(shared) if shared is not None else None
        wire = to_wire(value, memo=memo) if tag == "ok" else value
        extra = []
        if shared is not None:
            # Only what the program still holds can change later or come back: the rest leaves the
            # mirror on both sides (so the mirror, and each call's cost, stays as small as the state the
            # program keeps between calls).
            a = k = out = value = None
            keep = _live(shared)
            extra = [states, keep]
        out = json.dumps([tag, wire] + extra, separators=(",", ":")).encode()
        if len(out) > RESULT_LIMIT:
            raise ValueError(f"return value over {RESULT_LIMIT} bytes encoded")
        if shared is not None:
            _compact(shared, keep)
        return out
    except BaseException as e:  # noqa: BLE001
        if shared is not None:
            _compact(shared, [])  # the judge drops its mirror too on an answer without one
        info = {"type": type(e).__name__, "msg": str(e)[:300] if _plain_str(e) else "", "errno": None}
        try:
            return json.dumps(["err", info]).encode()
        except BaseException:  # noqa: BLE001
            return b'["err",{"type":"Error","msg":"","errno":null}]'


def _target(handles: Handles, fn):
    """What the judge asks of an object of the program it holds by number (`_Remote`): ["call", k] calls
    it, ["get", k, name] reads an attribute, ["set", k, name] sets one (to the call's one argument). The
    program's own code (properties, `__getattr__`, `__setattr__`) runs here, under its limits."""
    if type(fn) is not list or len(fn) not in (2, 3) or fn[0] not in ("call", "get", "set"):
        raise ValueError("malformed request")
    obj = handles.get(fn[1])
    if fn[0] == "call":
        return obj
    name = fn[2] if len(fn) == 3 else None
    if type(name) is not str:
        raise ValueError("malformed request")
    if fn[0] == "get":
        return lambda: getattr(obj, name)
    return lambda value: setattr(obj, name, value)


def _plain_str(e: BaseException) -> bool:
    try:
        return type(str(e)) is str
    except BaseException:  # noqa: BLE001 - a message that cannot be printed is sent empty
        return False


MIRROR_MAX = 100_000  # containers the mirror may hold (each call sends all their contents both ways)


def _reindex(m: Shared) -> None:
    """`m.ids` for the containers `from_wire` appended to `m.objs` (it fills the list only)."""
    for i in range(len(m.ids), len(m.objs)):
        m.ids[id(m.objs[i])] = i
    if len(m.ids) != len(m.objs):
        m.ids = {id(o): i for i, o in enumerate(m.objs)}


def _compact(m: Shared, keep) -> None:
    """Keep only the mirror's numbers `keep` (a sorted list), renumbered 0, 1, ...; ValueError if malformed."""
    if type(keep) is not list or any(type(i) is not int for i in keep):
        raise ValueError("malformed mirror")
    if keep != sorted(set(keep)) or (keep and not 0 <= keep[0] <= keep[-1] < len(m.objs)):
        raise ValueError("malformed mirror")
    m.objs[:] = [m.objs[i] for i in keep]
    m.ids = {id(o): i for i, o in enumerate(m.objs)}


def _mirror_apply(m: Shared, keep, pre) -> None:
    """Keep only the numbers `keep` (renumbered 0..), then give each container the contents `pre[k]`
    (containers first seen in `pre` are appended in order, as the judge numbered them)."""
    if type(pre) is not list:
        raise ValueError("malformed mirror")
    _compact(m, keep)
    for k, state in enumerate(pre):
        if k >= len(m.objs):
            raise ValueError("malformed mirror")
        _update(m.objs[k], state, m.objs)
    _reindex(m)


def _mirror_states(m: Shared) -> list:
    """The contents of every mirrored container now (containers first met here are added and sent too)."""
    states, k = [], 0
    while k < len(m.objs):
        if k >= MIRROR_MAX:
            raise ValueError(f"more than {MIRROR_MAX} containers shared between the tests and the program")
        states.append(_contents(m.objs[k], m))
        k += 1
    return states


def _contents(node, memo):
    """What a container argument holds now, for the judge to copy into its own object (see `_call`);
    None for tuples and frozensets, which cannot change."""
    t = type(node)
    if t is list:
        return [to_wire(x, 1, memo) for x in node]
    if t is collections.OrderedDict:  # its own order, as iterating it in the tests gives
        return [[to_wire(k, 1, memo), to_wire(x, 1, memo)] for k, x in collections.OrderedDict.items(node)]
    if t in (dict, collections.Counter, collections.defaultdict):
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
        if not (stage == "tests" and type(e) is SystemExit and e.code in (None, 0)) and not _REFUSED:
            info = _RAISED["info"] if _RAISED and _RAISED.get("exc") is e else None
            _record(write, verdict, b"E", e, "candidate" if info is not None else stage)
            if info is not None:
                write(verdict, b"C" + json.dumps(info).encode() + b"\n")
            exit_(1)
    if _REFUSED:  # also when the tests caught the refusal: never PASS
        _record(write, verdict, b"E", _REFUSED[0], "refused")
        exit_(1)
    write(verdict, b"PASS\n")
    exit_(0)


class JudgeRefusal(BaseException):
    """The judge cannot give plain Python's verdict for what the tests just did (a BaseException: tests
    catching Exception do not swallow it; `_REFUSED` keeps it even if they catch it)."""


_REFUSED: list = []
_CALLS = [0]  # calls of the program's functions the tests made so far


def _refuse(why: str):
    e = JudgeRefusal(why)
    _REFUSED[:] = [e]
    raise e


class _Drained:
    """An iterator (a generator, map, ...) the program returned: the candidate drained it when the call
    returned, where plain Python would run it as the tests consume it. The two agree while nothing it
    could read has changed, so consuming it after another call of the program, or after the tests changed
    that call's arguments, is refused (deterministically, with the reason)."""

    def __init__(self, items: list, nodes: list):
        self._items, self._nodes, self._at = iter(items), nodes, _CALLS[0]
        self._state = _fingerprint(nodes)

    def __iter__(self):
        return self

    def __next__(self):
        if _CALLS[0] != self._at or _fingerprint(self._nodes) != self._state:
            _refuse(
                "refused: the tests consume an iterator the program returned after calling it again or "
                "changing its arguments; the sandbox drains iterators when the call returns"
            )
        return next(self._items)


def _fingerprint(nodes: list) -> str:
    """The contents of a call's arguments now (as `_contents` sends them)."""
    memo = Shared(nodes, handles=_MIRROR.objs.handles)
    try:
        return json.dumps([_contents(n, memo) for n in nodes])
    except (TypeError, ValueError, RecursionError):
        return ""


def _live(m: Shared) -> list[int]:
    """The numbers of mirrored containers the tests can still reach: held from outside the mirror
    (a reference count above the mirror's own), or inside one that is. The others are dropped on both
    sides (the program may keep its copy; the tests can never look at it again)."""
    inner: collections.Counter = collections.Counter()
    for o in m.objs:
        for c in _children(o):
            inner[id(c)] += 1
    # References: the mirror's list, getrefcount's argument, and the inner ones (no loop variable, no
    # enumerate tuple: either would hold one more).
    objs = m.objs
    todo = [i for i in range(len(objs)) if sys.getrefcount(objs[i]) - 2 - inner[id(objs[i])] > 0]
    seen = set(todo)
    while todo:
        for c in _children(m.objs[todo.pop()]):
            j = m.ids.get(id(c))
            if j is not None and j not in seen and m.objs[j] is c:
                seen.add(j)
                todo.append(j)
    return sorted(seen)


_MIRRORED_DICTS = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)


def _children(o) -> list:
    t = type(o)
    if t in (list, tuple, set, frozenset):
        return list(o)
    if t in _MIRRORED_DICTS:
        return [*dict.keys(o), *dict.values(o)]
    return []


def _refuse_use(name: str):
    def refused(self, *args, **kwargs):
        _refuse(
            f"refused: the tests use {name} on an object of the program that is not a plain builtin value "
            "(an instance or a class of its own, a function it returned): plain Python would run the object's "
            "own code on the tests' side, which the judge does not let decide a verdict; the tests may "
            "pass such an object back to the program, call it, read and set its attributes and compare it "
            "with `is`"
        )

    refused.__name__ = name
    return refused


_PIPES: list = []  # the judge's (request, response) pipes to the candidate


def _proxy(name: str, req, resp):
    """The tests' stand-in for the program's function (or class) `name`: calls it in the candidate."""
    _PIPES[:] = [req, resp]
    return _Name(name)


class _Name:
    """A name of the program in the tests: calling it calls the program's function (or class) in the
    candidate. `isinstance(x, Name)` and subclassing it would need the program's class on the tests'
    side: refused with the reason (plain Python would answer; the judge has no class to answer with)."""

    __slots__ = ("__name__", "__qualname__")

    def __init__(self, name: str):
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        return _ask(self.__name__, args, kwargs, self.__name__)

    def __repr__(self):
        return f"<function {self.__name__}>"

    __instancecheck__ = __subclasscheck__ = __mro_entries__ = _refuse_use("isinstance() or subclassing")


def _ask(fn, args, kwargs, label: str):
    """Make one request of the candidate (`fn`: a name of the program, or an operation on one of its
    objects, see `_child._target`) and return its answer as plain Python would see it."""
    req, resp = _PIPES
    _CALLS[0] += 1
    memo = _MIRROR
    try:
        keep = _live(memo)
        memo.objs[:] = [memo.objs[i] for i in keep]
        memo.ids = {id(o): i for i, o in enumerate(memo.objs)}
        pre = _mirror_states(memo)
        msg = json.dumps([fn, to_wire(list(args), memo=memo), to_wire(kwargs, memo=memo), keep, pre],
                         separators=(",", ":"))  # fmt: skip
    except (TypeError, ValueError) as e:
        raise _candidate_exception(
            {"type": "ArgumentError", "msg": f"cannot send arguments to {label}: {e}"}
        ) from None
    try:
        req.write(msg.encode() + b"\n")
        line = resp.readline(RESULT_LIMIT + 64)
    except OSError:
        line = b""
    if not line.endswith(b"\n"):
        raise _candidate_exception({"type": "Exited", "msg": f"the program did not answer a call of {label}"})
    try:
        kind, value, *states = parse_record(line.decode("utf-8", "replace"))
        nodes = memo.objs
        if states:
            # Every mirrored container as the program left it: copied into the tests' own objects,
            # in place (containers first met there are appended, as the program numbered them).
            if type(states[0]) is not list or len(states[0]) < len(nodes):
                raise ValueError("malformed argument states")
            for k, state in enumerate(states[0]):
                if k >= len(nodes):
                    raise ValueError("malformed argument states")
                _update(nodes[k], state, nodes)
            _reindex(memo)
        if kind == "ok":
            out = from_wire(value, nodes=nodes) if states else from_wire(value)
            _reindex(memo)
            if type(value) is dict and value.get("t") == "iter":
                out = _Drained(list(out), list(nodes) if states else [])
        # What the program still holds stays mirrored; the rest is dropped (see `_call`).
        _compact(memo, states[1] if len(states) > 1 else [])
        if kind == "ok":
            return out
        info = value if kind == "err" else {"type": "Malformed"}
    except (ValueError, TypeError, RecursionError):
        _compact(memo, [])
        info = {"type": "Malformed", "msg": "the program's answer is not a plain builtin value"}
    raise _candidate_exception(info)


def _number(stand_in) -> int:
    return _MIRROR.objs.handles.ids[id(stand_in)]


class _Remote:
    """The tests' stand-in for an object of the program that is not a plain builtin value (`Handles`):
    calling it, reading or setting an attribute (a method, then its call) asks the program, as plain
    Python runs the program's code for them; passed back to the program it is the program's object
    again; `is` compares the program's identities. Anything plain Python would answer by running the
    object's own methods on the tests' side (==, <, hash, truth, len, iteration, str, arithmetic, copy,
    isinstance) is refused with the reason (`JudgeRefusal`): whether a test passes never rests on a
    comparison the program wrote."""

    __slots__ = ()

    def __getattr__(self, name):
        return _ask(["get", _number(self), name], (), {}, f"attribute {name!r}")

    def __setattr__(self, name, value):
        _ask(["set", _number(self), name], (value,), {}, f"attribute {name!r}")

    def __call__(self, *args, **kwargs):
        return _ask(["call", _number(self)], args, kwargs, "an object of the program")

    __class__ = property(_refuse_use("__class__"))  # isinstance() of a class the stand-in is not


_REFUSED_USES = (
    "eq ne lt le gt ge hash bool len length_hint iter next reversed contains getitem setitem delitem "
    "missing repr str format bytes int float complex index round trunc floor ceil abs neg pos invert add "
    "radd sub rsub mul rmul matmul rmatmul truediv rtruediv floordiv rfloordiv mod rmod divmod rdivmod "
    "pow rpow lshift rlshift rshift rrshift and rand or ror xor rxor iadd isub imul imatmul itruediv "
    "ifloordiv imod ipow ilshift irshift iand ior ixor enter exit aenter aexit await aiter anext sizeof "
    "dir reduce reduce_ex copy deepcopy getstate fspath delattr instancecheck subclasscheck buffer "
    "release_buffer get set delete"
)
for _name in _REFUSED_USES.split():
    setattr(_Remote, f"__{_name}__", _refuse_use(f"__{_name}__"))
del _name

_MIRROR = Shared(handles=Handles(make=lambda k: object.__new__(_Remote)))  # the judge's side of the mirror
