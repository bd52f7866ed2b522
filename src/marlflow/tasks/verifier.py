"""math-verify in a pool of helper processes, safe to call from any thread: `math_equal(pred, gold, timeout)`.

math-verify normally times out with signal.alarm, which fails outside the main thread (the tasks score answers
in a thread pool), so it runs here with its own timeouts disabled, inside helper processes that are killed and
replaced when a check overruns; an overrun counts as a wrong answer. The helpers are killed at exit
(`close_verifiers`).

    from marlflow.tasks.verifier import verify
    verify("x^2", "x**2", timeout=5.0)      # True, decided by math-verify in a helper process

marlflow.tasks.math.math_equal decides exact string and number matches itself and asks `verify` for the rest.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import queue
import selectors
import subprocess
import sys
import threading
from pathlib import Path


class _VerifierProc:
    """One math-verify helper process: JSON lines in, JSON lines out."""

    def __init__(self):
        pkg_parent = str(Path(__file__).resolve().parents[2])
        boot = f"import sys; sys.path.insert(0, {pkg_parent!r}); from marlflow.tasks.verifier import _serve; _serve()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", boot],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def ask(self, pred: str, gold: str, timeout: float) -> bool | None:
        self.proc.stdin.write(json.dumps([pred, gold]) + "\n")
        self.proc.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
        sel.close()
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def close(self):
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()


_IDLE: queue.LifoQueue = queue.LifoQueue()
_LOCK = threading.Lock()
_ALL: list[_VerifierProc] = []


def _startup_budget(timeout: float) -> float:
    return timeout + 60.0  # the first call also pays for importing sympy in the helper


def verify(pred: str, gold: str, timeout: float = 5.0) -> bool:
    """math-verify's verdict on `pred` against `gold` (both non-empty, stripped), from an idle helper process
    (a new one if none is idle); False when the helper overruns `timeout` seconds (it is killed) or dies.
    Safe in any thread."""
    try:
        proc = _IDLE.get_nowait()
        budget = timeout
    except queue.Empty:
        proc = _VerifierProc()
        with _LOCK:
            _ALL.append(proc)
        budget = _startup_budget(timeout)
    ans = proc.ask(pred, gold, budget)
    if ans is None:  # overran or died: kill it so the computation does not keep running
        proc.close()
        with _LOCK:
            _ALL.remove(proc)
        return False
    _IDLE.put(proc)
    return bool(ans)


def close_verifiers() -> None:
    with _LOCK:
        for p in _ALL:
            p.close()
        _ALL.clear()
    while not _IDLE.empty():
        _IDLE.get_nowait()


atexit.register(close_verifiers)


def _mv_equal(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    def P(s):
        return parse(s if "\\boxed" in s else f"\\boxed{{{s}}}", parsing_timeout=None)

    g, p = P(gold), P(pred)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=None))


def _serve() -> None:
    import logging

    logging.disable(logging.WARNING)  # math-verify warns on every call that its timeouts are off
    for line in sys.stdin:
        try:
            pred, gold = json.loads(line)
            ok = _mv_equal(pred, gold)
        except Exception:  # noqa: BLE001 - an unparsable answer is a wrong answer
            ok = False
        sys.stdout.write(json.dumps(ok) + "\n")
        sys.stdout.flush()
