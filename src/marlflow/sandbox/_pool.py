"""The pool: long-lived sandbox workers in the caller's process tree, `verify_many` and its verdict cache.

The caller's process is the trusted side: it converts tests, keeps the expected values, sends each worker
only what the candidate may see, and judges the raw records that come back (`_verdict`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import selectors
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from marlflow.sandbox._result import SandboxResult, show
from marlflow.sandbox._supervisor import _read_exact, _send
from marlflow.sandbox._verdict import CACHEABLE, Prepared, error, prepare, verdict

_CACHE_SIZE = 65536  # verdicts
# Characters of stdout/stderr/detail the cache may hold in all: a program printing OUTPUT_CAP per verdict
# must not grow the trainer's memory to gigabytes (65536 x 128 KiB); least recently used go first.
_CACHE_CHARS = 64 << 20
_WARNED: list[bool] = []


def _warn_no_landlock(info: dict) -> None:
    if info.get("landlock_abi", 0) >= 1 or _WARNED:
        return
    _WARNED.append(True)
    sys.stderr.write(
        "\n" + "!" * 100 + "\nmarlflow.sandbox: WARNING: this kernel has no Landlock (Linux >= 5.13 with "
        "landlock in the LSM list). Untrusted programs are contained\nby the read-only view, the PID, mount and "
        "network namespaces, seccomp and the uid/capability drop, without Landlock's\nsecond check on files, "
        "exec, TCP and signals (docs/sandbox.md).\n" + "!" * 100 + "\n"
    )
    sys.stderr.flush()


class SandboxUnavailable(RuntimeError):
    """No sandbox worker could be started (or the kernel layers are missing): raised, loudly, to the
    caller; unlike anything that goes wrong with one job, it is never turned into a verdict."""


class _Worker:
    def __init__(self):
        import subprocess  # not at module level: the worker itself must not import it

        self.closed = False
        self.waiting = None

        pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        boot = (
            f"import sys; sys.path.insert(0, {pkg_parent!r}); "
            "from marlflow.sandbox._supervisor import _serve; _serve()"
        )
        # MARLFLOW_SANDBOX_*: the deployment switches of docs/sandbox.md (_kernel's docstring).
        keep = ("PATH", "LANG", "TMPDIR")
        env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("MARLFLOW_SANDBOX_")}
        # One string-hash seed for every worker: a program's set/dict order of strings is then the same
        # whichever worker runs it, so a cached verdict is the verdict it would get again (see verify_many).
        env["PYTHONHASHSEED"] = "0"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            start_new_session=True, close_fds=True, bufsize=0,
        )  # fmt: skip
        self.info = self._read(60.0)
        if self.info is None:
            self.close()
            raise RuntimeError("sandbox worker failed to start")
        if self.info.get("refused"):  # a kernel layer is missing: never run untrusted code (docs/sandbox.md)
            self.close()
            sys.stderr.write("\n" + "!" * 100 + "\n" + self.info["refused"] + "\n" + "!" * 100 + "\n")
            raise RuntimeError(self.info["refused"])
        _warn_no_landlock(self.info)

    def _read(self, timeout: float):
        fd = self.proc.stdout.fileno()
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            # In slices: `close()` from another thread (SandboxPool.close) must wake this reader, and an
            # epoll set forgets a pipe closed under it.
            while not sel.select(min(0.25, max(0.0, deadline - time.monotonic()))):
                if self.closed or time.monotonic() >= deadline:
                    return None
        finally:
            sel.close()
        import json
        import struct

        head = _read_exact(fd, 4)
        if head is None:
            return None
        data = _read_exact(fd, struct.unpack("<I", head)[0])
        return None if data is None else json.loads(data)

    def run(self, head: dict, part: dict | None) -> dict | None:
        try:
            _send(self.proc.stdin.fileno(), head)
            if head.get("mode") == "judge":
                _send(self.proc.stdin.fileno(), part or {})
        except (BrokenPipeError, OSError):
            return None
        try:
            raw = self._read(float(head["timeout"]) + 30.0)
            if isinstance(raw, dict):
                self.waiting = raw.get("waiting")  # this worker's candidate cloned ahead for the next job
            return raw
        except (OSError, ValueError):  # closed by another thread while reading
            if self.closed:
                return None
            raise

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()  # dead before its pipes are closed: a reader sees EOF, not a closed fd
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
            self.proc.stdout.close()
        self.proc.wait()


class SandboxPool:
    """`max_workers` long-lived sandbox workers; each starts a fresh candidate per program.
    A worker that dies (or hangs, or whose job went wrong) is replaced. Use as a context manager or
    call `close()`, which wakes every job waiting for a worker (SandboxUnavailable). Jobs are validated
    before any worker is taken, so a bad job cannot wedge the pool. A pool belongs to the process that
    made it: in a forked child (multiprocessing's default start method on Linux) it raises instead of
    waiting on threads and workers that are the parent's (`verify_many` starts a new shared pool there).
    Workers outlive the thread that started them."""

    def __init__(self, max_workers: int | None = None):
        self.max_workers = max(1, max_workers or os.cpu_count() or 1)
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []
        self._starting = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._exec = ThreadPoolExecutor(self.max_workers, thread_name_prefix="sandbox")
        self._closed = False
        self._pid = os.getpid()
        self.programs_run = 0  # programs handed to workers; the cache test counts these

    def _owned(self) -> None:
        """RuntimeError in any process but the one that made this pool (a forked child), or once closed."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this SandboxPool belongs to process {self._pid}; process {os.getpid()} is a fork of it and "
                "cannot use its workers or threads: make a new SandboxPool in this process (verify_many does)"
            )
        if self._closed:
            raise RuntimeError("SandboxPool is closed")

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise SandboxUnavailable("the SandboxPool was closed while this job waited for a worker")
                if self._idle:
                    return self._idle.pop()
                if len(self._all) + self._starting < self.max_workers:
                    self._starting += 1
                    break
                self._cond.wait()
        try:
            w = _Worker()
        finally:
            with self._cond:
                self._starting -= 1
                self._cond.notify_all()
        with self._cond:
            if not self._closed:
                self._all.append(w)
                return w
        w.close()
        raise SandboxUnavailable("the SandboxPool was closed while this job waited for a worker")

    def _release(self, w: _Worker) -> None:
        with self._cond:
            if not self._closed:
                self._idle.append(w)
                self._cond.notify()
                return
        w.close()

    def start(self) -> SandboxPool:
        """Start all workers now (otherwise they start on first use)."""
        self._owned()
        got = []
        try:
            while len(got) < self.max_workers and len(self._all) < self.max_workers:
                got.append(self._acquire())
        finally:
            for w in got:
                self._release(w)
        return self

    def _retire(self, w: _Worker) -> None:
        w.close()
        with self._cond:
            if w in self._all:
                self._all.remove(w)
            self._cond.notify_all()

    def _once(self, head: dict, part: dict | None) -> dict | None:
        try:
            w = self._acquire()
        except Exception as e:  # no worker at all: the deployment's failure, never one job's verdict
            raise SandboxUnavailable(str(e)) from e
        with self._lock:
            self.programs_run += 1
        raw = None
        try:
            raw = w.run(head, part)
        finally:
            if raw is None:
                self._retire(w)  # also on an exception: the worker's protocol state is unknown
            else:
                self._release(w)
        if raw is None and self._closed:
            raise SandboxUnavailable("the SandboxPool was closed while this job ran")
        return raw

    def run_prepared(self, p: Prepared) -> SandboxResult:
        """The verdict of one prepared job; never raises: whatever goes wrong is this job's `error`."""
        try:
            return self._run_prepared(p)
        except SandboxUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - one job must never take the batch (or the rollout) down
            return error(f"the sandbox could not run this job: {type(e).__name__}: {show(str(e), 300)}")

    def _run_prepared(self, p: Prepared) -> SandboxResult:
        if p.error is not None:
            return p.error
        if p.cases is None:
            raw = self._once(p.head, p.part)
            if raw is None:
                return SandboxResult("crashed", False, detail="sandbox worker died or hung; replaced")
            return verdict(p, raw)
        # stdio: one program per case, stopping at the first failure (the comparison happens here).
        total, r = 0.0, None
        for stdin, expect in p.cases:
            raw = self._once(dict(p.head, stdin=stdin), None)
            if raw is None:
                return SandboxResult("crashed", False, detail="sandbox worker died or hung; replaced")
            r = verdict(p, raw, expect)
            total += r.seconds
            if not r.passed:
                break
        return SandboxResult(r.status, r.passed, r.stdout, r.stderr, round(total, 4), r.detail)

    def run(self, job, timeout: float = 5.0, memory_mb: int = 1024) -> SandboxResult:
        """One job: (code, tests), (code, tests, stdin, expect) or a dict (see `verify_many`)."""
        p = prepare(job, timeout, memory_mb)
        self._owned()
        return self.run_prepared(p)

    def map(self, jobs, timeout: float = 5.0, memory_mb: int = 1024) -> list[SandboxResult]:
        self._owned()
        prepared = _prepare_all(jobs, timeout, memory_mb)
        return list(self._exec.map(self.run_prepared, prepared))

    def close(self) -> None:
        """Stop the workers and wake every job waiting for one. In a forked child, only marks the pool
        closed: its workers are the parent's."""
        if os.getpid() != self._pid:  # (its lock may have been held by another thread at the fork)
            self._closed = True
            return
        with self._cond:
            self._closed = True
            workers, self._all, self._idle = list(self._all), [], []
            self._cond.notify_all()
        for w in workers:  # a job running on one gets EOF at once and raises SandboxUnavailable
            w.close()
        self._exec.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _prepare_all(jobs, timeout, memory_mb) -> list[Prepared]:
    out = []
    for i, j in enumerate(jobs):
        try:
            out.append(prepare(j, timeout, memory_mb))
        except (ValueError, TypeError) as e:
            raise type(e)(f"job {i}: {e}") from None
    return out


_POOLS: dict[int, SandboxPool] = {}
_POOLS_LOCK = threading.Lock()
_CACHE: collections.OrderedDict[str, SandboxResult] = collections.OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHED_CHARS = [0]


def _chars(r: SandboxResult) -> int:
    return len(r.stdout) + len(r.stderr) + len(r.detail)


def _pool(max_workers: int | None) -> SandboxPool:
    n = max(1, max_workers or os.cpu_count() or 1)
    with _POOLS_LOCK:
        if n not in _POOLS or _POOLS[n]._pid != os.getpid():
            _POOLS[n] = SandboxPool(n)
        return _POOLS[n]


def _after_fork_in_child() -> None:
    """A forked child starts with no shared pool (the parent's workers and threads are not its own; they
    are left alone, never closed from here) and fresh locks (another thread may have held them)."""
    global _POOLS_LOCK, _CACHE_LOCK
    _POOLS_LOCK, _CACHE_LOCK = threading.Lock(), threading.Lock()
    for p in _POOLS.values():
        p._closed = True
    _POOLS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def shutdown() -> None:
    """Stop the shared pools (also runs at interpreter exit)."""
    with _POOLS_LOCK:
        for p in _POOLS.values():
            p.close()
        _POOLS.clear()


def programs_run() -> int:
    """Programs the shared pools have run so far (cache hits and deduplicated jobs run none)."""
    with _POOLS_LOCK:
        return sum(p.programs_run for p in _POOLS.values())


def clear_cache() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()
        _CACHED_CHARS[0] = 0


def verify_many(
    jobs, timeout: float = 5.0, memory_mb: int = 1024, max_workers: int | None = None, cache: bool = True
) -> list[SandboxResult]:
    """Verify jobs in parallel in the shared pool. A job is (code, tests) or (code, tests, stdin, expect)
    or a dict with those keys (and optional timeout, memory_mb, entry_point, prelude, setup). Results
    come back in job order. A malformed job (wrong types, limits out of range, empty tests) raises
    ValueError/TypeError naming it before anything runs; anything that goes wrong while judging a job is
    that job's verdict (`error` with the reason), never an exception. Only a sandbox that cannot start at
    all raises (SandboxUnavailable, a RuntimeError): that is the deployment's failure, not a job's.

    Identical jobs are verified once and their verdicts cached only when the verdict is reproducible:
    the program and tests use no source of randomness or time (`_verdict.deterministic`) and the status
    is one of CACHEABLE (never a timeout, memory or crash, which can depend on the machine's load).
    Other jobs run every time they are given, duplicates included, as they would without the cache."""
    prepared = _prepare_all(jobs, timeout, memory_mb)
    keys = [p.key if p.deterministic else f"{p.key}#{i}" for i, p in enumerate(prepared)]
    results: dict[str, SandboxResult] = {}
    if cache:
        with _CACHE_LOCK:
            for k in keys:
                if k in _CACHE:
                    _CACHE.move_to_end(k)
                    results[k] = _CACHE[k]
    todo = {k: p for k, p in zip(keys, prepared) if k not in results}
    if todo:
        pool = _pool(max_workers)
        pool._owned()
        fresh = list(pool._exec.map(pool.run_prepared, todo.values()))
        for (k, p), r in zip(todo.items(), fresh):
            results[k] = r
            if cache and p.deterministic and r.status in CACHEABLE:
                with _CACHE_LOCK:
                    if k not in _CACHE:
                        _CACHE[k] = r
                        _CACHED_CHARS[0] += _chars(r)
                    while len(_CACHE) > _CACHE_SIZE or _CACHED_CHARS[0] > _CACHE_CHARS:
                        _CACHED_CHARS[0] -= _chars(_CACHE.popitem(last=False)[1])
    return [results[k] for k in keys]


def verify(code: str, tests: str, stdin: str | None = None, expect: str | None = None, **kw) -> SandboxResult:
    """One job through `verify_many`."""
    job = (code, tests) if stdin is None and expect is None else (code, tests, stdin or "", expect or "")
    return verify_many([job], **kw)[0]


def run_local(
    code: str, tests: str, stdin=None, expect=None, timeout=5.0, memory_mb=1024, entry_point=None
) -> SandboxResult:
    """Run one job in a fresh one-worker pool (what the command line does). A malformed job raises
    ValueError/TypeError (as `verify_many`); every other failure is the returned verdict."""
    job = {
        "code": code,
        "tests": tests,
        "stdin": stdin,
        "expect": expect,
        "timeout": timeout,
        "memory_mb": memory_mb,
        "entry_point": entry_point,
    }
    p = prepare(job)
    try:
        with SandboxPool(1) as pool:
            return pool.run_prepared(p)
    except SandboxUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. closing a worker failed: still one verdict
        return error(f"the sandbox failed: {type(e).__name__}: {show(str(e), 300)}")
