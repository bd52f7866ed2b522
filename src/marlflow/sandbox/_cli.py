"""Command line: one job, one JSON object on stdout, in every case. Exit 0 whatever the verdict (an
`error` verdict included: a job the sandbox could not judge); bad arguments, unreadable files or a
malformed job (empty tests, limits out of range) give a one-line JSON error (`status: usage_error`) and
exit 2; a sandbox that cannot start (`SandboxUnavailable`, docs/sandbox.md) or an unexpected failure of
this command itself gives one JSON line with `status: error` and exit 1.
Never a traceback."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from marlflow.sandbox._pool import run_local
from marlflow.sandbox._result import MAX_MEMORY_MB, MAX_TIMEOUT, check_limits


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit 2 with a multi-line message
        raise _UsageError(message)


def _fail(msg: str) -> int:
    sys.stdout.write(json.dumps({"error": msg, "status": "usage_error"}) + "\n")
    return 2


def _read(path: str, what: str) -> str:
    if os.path.isdir(path):
        raise _UsageError(f"{what} {path!r} is a directory; give a file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _UsageError(f"cannot read {what} {path!r}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _UsageError(f"{what} {path!r} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None


def _seconds(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not math.isfinite(v) or v <= 0 or v > MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(f"must be finite, > 0 and <= {MAX_TIMEOUT:g} seconds, got {s!r}")
    return v


def _mib(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if not 1 <= v <= MAX_MEMORY_MB:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_MEMORY_MB} MiB, got {s!r}")
    return v


def main(argv=None) -> int:
    ap = _Parser(prog="marlflow sandbox", description="Run an untrusted program against tests.")
    ap.add_argument("--code", required=True, help="file with the untrusted solution")
    ap.add_argument("--tests", help="file with Python test code (optional with --stdin/--expect)")
    ap.add_argument("--stdin", help="file fed to the program's stdin")
    ap.add_argument("--expect", help="file with the expected stdout (whitespace-insensitive)")
    ap.add_argument(
        "--timeout",
        type=_seconds,
        default=5.0,
        help=f"wall-clock seconds, 0 < t <= {MAX_TIMEOUT:g} (default 5)",
    )
    ap.add_argument("--memory-mb", type=_mib, default=1024, help="address-space limit in MiB (default 1024)")
    ap.add_argument(
        "--entry-point",
        help="the program's function the tests call (as HumanEval's check(candidate)); other names the "
        "tests call are then never the program's",
    )
    try:
        a = ap.parse_args(argv)
        if a.tests is None and a.stdin is None and a.expect is None:
            raise _UsageError("give --tests (Python test code) or --stdin/--expect (a stdin/stdout case)")
        check_limits(a.timeout, a.memory_mb)
        code = _read(a.code, "--code")
        tests = _read(a.tests, "--tests") if a.tests else ""
        stdin = _read(a.stdin, "--stdin") if a.stdin else None
        stdio = a.stdin is not None or a.expect is not None
        expect = (_read(a.expect, "--expect") if a.expect else "") if stdio else None
        if a.entry_point is not None and not a.entry_point.isidentifier():
            raise _UsageError(f"--entry-point must be a Python identifier, got {a.entry_point!r}")
        r = run_local(code, tests, stdin if stdio else None, expect, a.timeout, a.memory_mb, a.entry_point)
    except (_UsageError, ValueError, TypeError) as e:
        return _fail(str(e))
    except SystemExit as e:  # argparse's --help exits 0 after printing the help: that is the answer
        if e.code in (0, None):
            return 0
        return _fail(f"exited with {e.code!r}")
    except BaseException as e:  # noqa: BLE001 - one JSON line in every case, even for our own bug
        sys.stdout.write(
            json.dumps({"status": "error", "passed": False, "error": f"{type(e).__name__}: {e}"[:1000]})
            + "\n"
        )
        return 1
    sys.stdout.write(json.dumps(r.to_dict()) + "\n")
    return 0
