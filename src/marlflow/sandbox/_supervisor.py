"""The supervisor: a long-lived worker process that starts one sandboxed candidate (and, for tests that
need it, one judge) per job, collects their output within the limits, and sends back raw records.

Candidates are forked by a zygote, not by this process: the zygote is forked once, right after the
worker's setup and before any job is received, and never receives a job itself (only the pipe ends of
the next candidate); it clones each candidate as this process's child (CLONE_PARENT), which then reads
its own job from a pipe. So a candidate's address space holds nothing of any other job (tests, expected
values, programs, arguments), even as freed memory that native code could scan (docs/sandbox.md).

It never decides `passed` and never receives expected values: the pool's caller judges the raw records
(`_verdict`). Protocol on stdin/stdout: 4-byte length + JSON. A job is one message; a judged job is
followed by a second message with the test code, read only after the candidate has been forked, so
the candidate's copy of this process's memory never contained it. Reads are unbuffered for the same
reason (a buffered reader would have read the second message ahead).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import resource
import select
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time

from marlflow.sandbox._child import _close_fds_except, candidate, judge
from marlflow.sandbox._kernel import (
    _LL_ABI,
    _PR_SET_CHILD_SUBREAPER,
    _PR_SET_PDEATHSIG,
    _SECCOMP,
    _build_view,
    _fork_isolated,
    _prctl,
    _probe_user_namespace,
    _read_roots,
    _unshare_network,
)
from marlflow.sandbox._result import (
    OUTPUT_CAP,
    RESULT_LIMIT,
    SANDBOX_UID_BASE,
    STDERR_LIMIT,
    STDOUT_LIMIT,
    TMP_PREFIX,
    check_limits,
)


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


# The kernel layers without which untrusted programs are not run (docs/sandbox.md): the audit hook alone
# does not hold native code or a determined program, so a machine that lacks one of these refuses loudly
# (the pool raises at start) unless MARLFLOW_SANDBOX_ALLOW_WEAK=1. Landlock is not among them: the view,
# the namespaces and seccomp hold its classes without it (the pool still warns).
REQUIRED_LAYERS = ("netns", "view", "pidns", "seccomp")
DEVICES = ["/dev/null", "/dev/urandom", "/dev/zero"]


def _probe_pidns() -> bool:
    """Can this process fork a child into new PID, mount and IPC namespaces?"""
    pid = _fork_isolated()
    if pid == 0:  # pragma: no cover - the probe child
        os._exit(0)
    if pid < 0:
        return False
    os.waitpid(pid, 0)
    return True


def _prepare_supervisor() -> dict:
    """Set up this (single-threaded) supervising process once: no network for it and its children, its
    own mount namespace holding the read-only view candidates chroot into, subreaper for escaped
    descendants, no secrets in its environment."""
    # Whatever the caller's umask (077 would make the view's folders unreadable for the sandbox uid, and
    # so silently keep the program as root) and fd limit (a soft limit lowered under fd pressure would stay
    # with this worker): this process's own, the same for every caller.
    os.umask(0o022)
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # (at most 65536: the children close every fd below that, `_child._close_fds_except`)
        inf = resource.RLIM_INFINITY
        cap = 65536 if hard == inf else hard
        want = min(max(cap, 4096) if os.geteuid() == 0 else cap, 65536)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard if hard == inf else max(hard, want)))
    roots = _read_roots()
    allow_weak = os.environ.get("MARLFLOW_SANDBOX_ALLOW_WEAK") == "1"
    info = {"netns": _unshare_network(), "landlock_abi": _LL_ABI, "root": os.geteuid() == 0}
    # /dev/shm makes the per-program mkdir/rmdir ~100x cheaper than a disk-backed /tmp. With a mount
    # namespace, the view is a tmpfs mounted over it in this process's namespace only: the working dirs
    # live there and vanish with this process, whatever kills it.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    view_w = _build_view(shm, roots, DEVICES)
    info["view"] = view_w is not None
    info["pidns"] = _probe_pidns()
    info["seccomp"] = _SECCOMP is not None
    # Unprivileged, every candidate keeps the caller's uid: each gets a user namespace of its own, so that
    # its task limit counts its own tasks only (`_kernel._own_user_namespace`). As root, a uid per worker.
    info["userns"] = not info["root"] and _probe_user_namespace()
    # Dropping to "nobody" is only possible when nobody can still read the Python install (in the view,
    # the folders above it are the view's own, world-readable).
    info["drop_uid"] = info["root"] and _others_can_read([shm + r for r in roots] if view_w else roots)
    info["nofile"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    missing = [k for k in REQUIRED_LAYERS if not info[k]]
    if info["root"] and not info["drop_uid"]:
        missing.append("uid drop (the sandbox uid cannot read the Python install)")
    if info["nofile"] < 64:
        missing.append(f"file descriptors (limit {info['nofile']} < 64)")
    info["missing"] = missing
    if missing and not allow_weak:
        info["refused"] = (
            f"marlflow.sandbox: refusing to run untrusted programs: the kernel refused {', '.join(missing)} "
            "(see docs/sandbox.md for what each deployment needs: root, or unprivileged user namespaces, on "
            "x86_64/aarch64 Linux). Without them the audit hook alone does not contain native code. Set "
            "MARLFLOW_SANDBOX_ALLOW_WEAK=1 to run anyway on trusted inputs only."
        )
    tmp = view_w or (shm if os.access(shm, os.W_OK | os.X_OK) else None)
    _SUPERVISOR.update(info, roots=roots, tmp=tmp, base=shm if view_w else None)
    # The candidate checks this pidfd to learn that this process died before its PDEATHSIG was set (in
    # its own PID namespace, getppid() is 0 whether or not we live).
    _SUPERVISOR["alive_fd"] = os.pidfd_open(os.getpid())
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    for k in list(os.environ):
        if k not in ("PATH", "LANG", "LC_ALL", "TMPDIR"):
            del os.environ[k]
    return info


_ZYGOTE: dict = {}
_FD_ORDER = ("job", "res", "out", "err", "req", "resp")  # the candidate's pipe ends, in the order sent


def _start_zygote():
    """Fork the zygote (see the module docstring), before any job is received: returns None in this
    process, the zygote's socket in the zygote (which then runs `_zygote`, from the caller's frame: the
    candidate's stack depth stays as it was). Where the raw clone syscall is not known here (no seccomp
    filter either, a weak deployment), there is none and candidates are forked by this process."""
    if _kernel_clone_missing():
        return None
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    me = os.getpid()
    pid = os.fork()
    if pid == 0:  # the zygote
        mine.close()
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != me:
            os._exit(0)
        alive = _SUPERVISOR.get("alive_fd")
        _close_fds_except({theirs.fileno(), alive if alive is not None else -1})
        return theirs
    theirs.close()
    _ZYGOTE.update(pid=pid, sock=mine)
    return None


def _kernel_clone_missing() -> bool:
    from marlflow.sandbox._kernel import _SYS_CLONE

    return _SYS_CLONE is None


def _zygote(sock: socket.socket) -> None:
    """The zygote's loop: for each request (one byte, nothing else), clone a candidate as the supervisor's
    child, ahead of its job (off the job's critical path), and send back its pid with one end of a socket
    pair (-1 and none if the kernel refused). The candidate waits on the other end for its pipe ends, then
    reads its job from the first pipe."""
    pidns = bool(_SUPERVISOR.get("pidns"))
    alive = _SUPERVISOR.get("alive_fd")
    while True:
        try:
            msg = sock.recv(16)
        except OSError:
            os._exit(0)
        if not msg:
            os._exit(0)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = _fork_isolated(sibling=True, namespaces=pidns)
        if pid == 0:  # pragma: no cover - the candidate never returns
            try:
                sock.close()
                mine.close()
                _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # its parent is the supervisor (CLONE_PARENT)
                if alive is not None and select.select([alive], [], [], 0)[0]:
                    os._exit(3)
                got, fds, _, _ = socket.recv_fds(theirs, 16, len(_FD_ORDER))
                if not got:
                    os._exit(0)
                theirs.close()
                cfds = dict(zip(_FD_ORDER, fds))
                job = _read_job(cfds.pop("job"))
                candidate(job, cfds, job["workdir"], _SUPERVISOR["roots"])
            finally:
                os._exit(4)
        theirs.close()
        try:
            socket.send_fds(sock, [struct.pack("<i", pid)], [mine.fileno()] if pid > 0 else [])
        except OSError:
            os._exit(0)
        mine.close()


def _read_job(fd: int) -> dict:
    """The candidate's job, read whole from the pipe the supervisor writes it to."""
    chunks = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            break
        chunks.append(b)
    os.close(fd)
    return json.loads(b"".join(chunks))


def _next_candidate() -> tuple[int, socket.socket | None]:
    """(pid, socket) of the candidate the zygote cloned ahead (requested now if none was): the reply to
    the last request. (-1, None) if the kernel refused; the worker exits if the zygote is gone (a new
    one forked now would hold this process's jobs; the pool replaces the whole worker instead)."""
    z = _ZYGOTE
    if not z.get("pending"):
        z["sock"].send(b"c")
    z["pending"] = False
    try:
        msg, fds, _, _ = socket.recv_fds(z["sock"], 16, 1)
    except OSError:
        msg, fds = b"", []
    if len(msg) != 4:
        os._exit(5)
    (pid,) = struct.unpack("<i", msg)
    if pid < 0 or not fds:
        return -1, None
    return pid, socket.socket(fileno=fds[0])


def _prefetch() -> None:
    """Ask the zygote for the next job's candidate now; `_next_candidate` reads the reply."""
    if _ZYGOTE and not _ZYGOTE.get("pending") and "next" not in _ZYGOTE:
        _ZYGOTE["sock"].send(b"c")
        _ZYGOTE["pending"] = True


def _waiting_candidate() -> int | None:
    """The pid of the candidate cloned ahead and waiting for its job (collecting the zygote's reply)."""
    if not _ZYGOTE:
        return None
    if "next" not in _ZYGOTE and _ZYGOTE.get("pending"):
        _ZYGOTE["next"] = _next_candidate()
    return _ZYGOTE["next"][0] if "next" in _ZYGOTE else None


def _spawn_candidate(job: dict, cfds: dict) -> int:
    """Start the candidate for `job` with its pipe ends `cfds`: one the zygote (where there is one) cloned
    ahead as this process's child, sent its pipes, then its job. Returns its pid; raises OSError if it
    could not start."""
    if not _ZYGOTE:
        pid = _fork_candidate()
        if pid == 0:  # pragma: no cover - the child never returns
            try:
                candidate(job, cfds, job["workdir"], _SUPERVISOR["roots"])
            finally:
                os._exit(4)
        return pid
    job_r, job_w = os.pipe()
    try:
        fds = [job_r] + [cfds[k] for k in _FD_ORDER[1:] if k in cfds]
        for attempt in range(2):
            pid, csock = _ZYGOTE.pop("next", None) or _next_candidate()
            if pid < 0:
                raise OSError("the kernel refused new namespaces for this program (too many at once?)")
            try:
                socket.send_fds(csock, [b"j"], fds)
                break
            except OSError:  # it died waiting (the next one is cloned now)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                if attempt:
                    raise
            finally:
                csock.close()
    finally:
        os.close(job_r)
    _prefetch()
    try:
        data = json.dumps(job).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(job_w, view) :]
    except BrokenPipeError:
        pass  # the candidate died before reading: its exit status says so
    finally:
        os.close(job_w)
    return pid


def supervise(job: dict, read_tests) -> dict:
    """Run one job; `read_tests()` gives the judge's part (called after the candidate is forked)."""
    t0 = time.monotonic()
    roots = _SUPERVISOR["roots"]
    base = _SUPERVISOR.get("base")
    job = dict(job, drop_uid=_SUPERVISOR.get("drop_uid", False), base=base, alive_fd=_SUPERVISOR.get("alive_fd"),
               uid=SANDBOX_UID_BASE + os.getpid(),
               layers={k: _SUPERVISOR.get(k) for k in ("pidns", "seccomp", "view", "userns")})  # fmt: skip
    judged = job["mode"] == "judge"
    workdir = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=_SUPERVISOR.get("tmp"))
    job["workdir"] = workdir
    pids: list[int] = []
    mine: list[int] = []
    bufs: dict[int, bytearray] = {}
    try:
        _prepare_workdir(job, workdir)
        res_r, res_w = _pipe(mine)
        out_r, out_w = _pipe(mine)
        err_r, err_w = _pipe(mine)
        cfds = {"res": res_w, "out": out_w, "err": err_w}
        if judged:
            req_r, req_w = _pipe(mine)
            resp_r, resp_w = _pipe(mine)
            cfds.update(req=req_r, resp=resp_w)
        pid = _spawn_candidate(job, cfds)
        pids.append(pid)
        for fd in cfds.values():
            os.close(fd)
            mine.remove(fd)
        bufs = {out_r: bytearray(), err_r: bytearray(), res_r: bytearray()}
        verdict_r = -1
        if judged:
            part = read_tests()
            v_r, v_w = _pipe(mine)
            jjob = {"tests": part.get("tests") or "", "prelude": part.get("prelude") or "",
                    "proxies": list(part.get("proxies") or ()), "timeout": job["timeout"], "memory_mb": job["memory_mb"]}  # fmt: skip
            jpid = os.fork()
            if jpid == 0:  # pragma: no cover
                try:
                    judge(jjob, {"verdict": v_w, "req": req_w, "resp": resp_r}, roots)
                finally:
                    os._exit(4)
            pids.append(jpid)
            del jjob, part
            for fd in (v_w, req_w, resp_r):
                os.close(fd)
                mine.remove(fd)
            bufs[v_r] = bytearray()
            verdict_r = v_r
        limits = {out_r: STDOUT_LIMIT, err_r: STDERR_LIMIT, res_r: RESULT_LIMIT + 4096, verdict_r: 1 << 16}
        keep = {out_r: STDOUT_LIMIT, err_r: OUTPUT_CAP, res_r: RESULT_LIMIT + 4096, verdict_r: 1 << 16}
        names = {out_r: "stdout", err_r: "stderr", res_r: "results", verdict_r: "verdict"}
        status, timed_out, over = _collect(pids, bufs, limits, keep, names, t0 + job["timeout"])
    finally:
        _clean_up(pids, mine, workdir)
    return {
        "mode": job["mode"],
        "exit": status.get(pids[0]),
        "judge_exit": status.get(pids[1]) if judged else None,
        "timed_out": timed_out,
        "over": over,
        "stdout": bytes(bufs[out_r]).decode("utf-8", "replace"),
        "stderr": bytes(bufs[err_r]).decode("utf-8", "replace"),
        "res": bytes(bufs[res_r]).decode("utf-8", "replace"),
        "verdict": bytes(bufs[verdict_r]).decode("utf-8", "replace") if judged else "",
        "seconds": round(time.monotonic() - t0, 4),
        "waiting": _waiting_candidate(),  # the next job's candidate, cloned ahead (tests count processes)
    }


def _pipe(mine: list[int]) -> tuple[int, int]:
    """os.pipe(), its two ends added to `mine` at once: when a later pipe fails (EMFILE), _clean_up closes the
    ones made before it."""
    r, w = os.pipe()
    mine += [r, w]
    return r, w


def _prepare_workdir(job: dict, workdir: str) -> None:
    """Hand the job's working dir to the sandbox uid (when the candidate drops to it) and write the job's
    stdin there, as `.stdin` (`job["stdin_path"]`; the candidate opens and deletes it)."""
    if job.get("drop_uid"):
        os.chown(workdir, job["uid"], job["uid"])
    if job.get("stdin") is not None:
        job["stdin_path"] = os.path.join(workdir, ".stdin")
        with open(job["stdin_path"], "w", encoding="utf-8") as f:
            f.write(job["stdin"])


def _fork_candidate() -> int:
    """Fork the candidate's process, as `os.fork` (0 in the child): PID 1 of its own PID namespace where
    the worker has one, its death then killing all it left behind. Output buffers are flushed first so
    the child does not write them again."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _SUPERVISOR.get("pidns"):
        pid = _fork_isolated()
        if pid < 0:
            raise OSError("the kernel refused new namespaces for this program (too many at once?)")
    else:
        pid = os.fork()
    return pid


def _clean_up(pids: list[int], mine: list[int], workdir: str) -> None:
    """After a job, whatever happened: kill the process group of every child forked (`pids`) and any
    descendant that escaped it, close the supervisor's own pipe ends still open (`mine`), and delete the
    working dir."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p, signal.SIGKILL)
    _reap_strays()
    for fd in mine:
        with contextlib.suppress(OSError):
            os.close(fd)
    shutil.rmtree(workdir, ignore_errors=True)


def _collect(pids: list[int], bufs: dict, limits: dict, keep: dict, names: dict, deadline: float):
    sel = selectors.DefaultSelector()
    pidfds = {}
    for p in pids:
        pidfds[os.pidfd_open(p)] = p
    for fd in list(pidfds) + list(bufs):
        sel.register(fd, selectors.EVENT_READ)
    open_fds, status, timed_out, over = set(bufs), {}, False, ""
    totals = collections.Counter()
    try:
        while open_fds or len(status) < len(pids):
            left = deadline - time.monotonic()
            if len(status) == len(pids):
                left = min(left, 0.05)  # children gone; only escaped holders keep pipes open
            if left <= 0:
                if len(status) < len(pids):
                    timed_out = True
                break
            for key, _ in sel.select(left):
                fd = key.fd
                if fd in pidfds:
                    status[pidfds[fd]] = os.waitpid(pidfds[fd], 0)[1]
                    sel.unregister(fd)
                    continue
                data = os.read(fd, 65536)
                if not data:
                    sel.unregister(fd)
                    open_fds.discard(fd)
                    continue
                totals[fd] += len(data)
                if len(bufs[fd]) < keep[fd]:
                    bufs[fd] += data[: keep[fd] - len(bufs[fd])]
                if totals[fd] > limits[fd] and not over:
                    over = names[fd]
                    for p in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(p, signal.SIGKILL)
    finally:
        sel.close()
        for fd in pidfds:
            os.close(fd)
    for p in pids:
        if p not in status:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p, signal.SIGKILL)
            status[p] = os.waitpid(p, 0)[1]
    return status, timed_out, over


def _children() -> set[int] | None:
    """This process's children now (None where the kernel has no /proc/PID/task/TID/children)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children", "rb") as f:
            return {int(x) for x in f.read().split()}
    except (OSError, ValueError):
        return None


def _reap_strays() -> None:
    """Kill descendants that escaped the group (we are their subreaper) and reap zombies; the zygote is
    the one child that stays."""
    zygote, waiting = _ZYGOTE.get("pid"), _waiting_candidate()
    keep = {p for p in (zygote, waiting) if p}
    try:
        # Cheap common case: no child left but the zygote and the candidate waiting for the next job
        # (orphaned descendants would be ours: subreaper).
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass
        if _children() == keep:
            return
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
                if stat[1].decode() == me and int(entry) not in keep:
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


def _serve() -> None:
    """Worker loop: length-prefixed JSON jobs on stdin, raw records on stdout."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # stray prints must never corrupt the protocol
    # The caller's death ends this worker (EOF on the protocol, or its pidfd when a process it forked
    # still holds the pipe). Not PR_SET_PDEATHSIG: that fires when the *thread* that started the worker
    # exits, and the pool starts workers from whichever thread needs one.
    caller = None
    with contextlib.suppress(OSError):
        caller = os.pidfd_open(os.getppid())
    info = _prepare_supervisor()
    zsock = _start_zygote() if not info.get("refused") else None
    if zsock is not None:  # the zygote: never returns
        try:
            _zygote(zsock)
        finally:
            os._exit(0)
    info["zygote"] = _ZYGOTE.get("pid")
    _send(proto_out, info)
    while True:
        if caller is not None:
            ready = select.select([proto_in, caller], [], [])[0]
            if caller in ready:
                return
        job = _recv(proto_in)
        if job is None:
            return
        judged = isinstance(job, dict) and job.get("mode") == "judge"
        pending = [judged]

        def read_tests(pending=pending):
            pending[0] = False
            return _recv(proto_in) or {}

        try:
            if not isinstance(job, dict) or job.get("mode") not in ("calls", "stdio", "judge"):
                raise ValueError("malformed job")
            job["timeout"], job["memory_mb"] = check_limits(job.get("timeout"), job.get("memory_mb"))
            if not isinstance(job.get("code"), str):
                raise ValueError("job code must be a string")
            if _SUPERVISOR.get("refused"):
                raise RuntimeError(_SUPERVISOR["refused"])
            out = supervise(job, read_tests)
        except Exception as e:  # noqa: BLE001 - a bad job or a supervisor bug must not kill the worker
            out = {"error": f"{type(e).__name__}: {e}"}
        if pending[0]:
            read_tests()  # keep the protocol in step
        _send(proto_out, out)


def _send(fd: int, obj) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(struct.pack("<I", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _recv(fd: int):
    head = _read_exact(fd, 4)
    if head is None:
        return None
    (n,) = struct.unpack("<I", head)
    data = _read_exact(fd, n)
    return None if data is None else json.loads(data)
