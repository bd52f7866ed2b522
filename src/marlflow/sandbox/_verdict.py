"""Jobs as the caller gives them -> what the worker is sent, and the worker's raw records -> a verdict.

Runs in the caller's (trusted) process: the expected values, expected stdout and the comparison live
only here. The worker and the candidate get the program, the call arguments or stdin, and limits.
Everything the candidate wrote is read within a budget (`_result.parse_record`, `from_wire`'s hash
check), and any failure while judging one job is that job's `error` verdict, never an exception; only a
malformed job (UsageError, a ValueError) is raised. `deterministic` decides which verdicts may be cached.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import re
import signal
import warnings
from dataclasses import dataclass, field

from marlflow.sandbox._convert import OPS, convert
from marlflow.sandbox._result import (
    CALLS_MARKER,
    OUTPUT_CAP,
    RESULT_LIMIT,
    STDERR_LIMIT,
    STDIO_MARKER,
    STDOUT_LIMIT,
    Refused,
    SandboxResult,
    check_limits,
    from_wire,
    outputs_match,
    parse_record,
    show,
    signal_name,
    to_wire,
)

_SYNTAX = ("SyntaxError", "IndentationError", "TabError")
# Statuses a reproducible program gets again on any machine at any load: the only ones the cache keeps.
CACHEABLE = frozenset({"passed", "failed", "syntax_error"})
# Modules with no randomness, clock or process state: a program importing only these (and using none of
# _DYNAMIC) computes the same thing every run. Anything else (random, time, os, secrets, uuid, datetime,
# threading, ...) or a dynamic import makes its verdict uncacheable.
_PURE_MODULES = frozenset({
    "__future__", "abc", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmath", "collections",
    "copy", "csv", "dataclasses", "decimal", "enum", "fractions", "functools", "hashlib", "heapq", "io",
    "itertools", "json", "keyword", "math", "numbers", "operator", "pprint", "queue", "re", "statistics",
    "string", "struct", "sys", "textwrap", "typing", "unicodedata", "zlib",
})  # fmt: skip
_DYNAMIC = frozenset({
    "__import__", "importlib", "eval", "exec", "compile", "open", "id", "hash", "globals", "locals", "vars",
    "getattr", "setattr", "delattr", "__builtins__", "__dict__", "__globals__", "__subclasses__", "modules",
    "_getframe", "__loader__", "__spec__", "breakpoint", "urandom", "getrandbits", "perf_counter",
    "attrgetter", "methodcaller", "__getattribute__", "__getattr__", "__class__", "__base__", "__bases__",
    "__mro__", "__code__", "__closure__", "__self__", "__func__", "__module__", "__reduce__", "__reduce_ex__",
    "getallocatedblocks", "getrefcount", "getpid", "monotonic", "process_time", "thread_time", "time_ns",
})  # fmt: skip


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# `import a.b as c, d` / `from .x import y`, wherever they stand (after `:` or `;` too). Possessive
# quantifiers: no backtracking, so the scan is linear in the text (`from` and 20 KB of blanks was
# quadratic). Blanks are Python's: space, tab, form feed; line continuations are joined first.
_IMPORT = re.compile(r"\bfrom[ \t\f]++(\.*+[\w.]*+)[ \t\f]*+import\b|\bimport[ \t\f]++([\w. \t\f,]++)")
_CONTINUATION = re.compile(r"\\[ \t\f]*+\r?\n")


def deterministic(*sources: str) -> bool:
    """True when none of `sources` (program, tests, prelude) can make a run differ from the last: every
    import is of a _PURE_MODULES module and no word of the text (code, strings, comments) is in
    _DYNAMIC. Read as text, not parsed (so a dynamic name hidden in a string counts too, and it costs
    microseconds); conservative: a False only costs a rerun. String hashes are fixed by the workers'
    PYTHONHASHSEED."""
    for src in sources:
        if not src:
            continue
        src = _CONTINUATION.sub(" ", src)
        for frm, names in _IMPORT.findall(src):
            mods = [frm] if frm else [x.split()[0] for x in names.split(",") if x.strip()]
            if any(m.startswith(".") or m.split(".")[0] not in _PURE_MODULES for m in mods):
                return False
        if not _DYNAMIC.isdisjoint(_WORD.findall(src)):
            return False
    return True


_LIMIT_OF = {"stdout": STDOUT_LIMIT, "stderr": STDERR_LIMIT, "results": RESULT_LIMIT}


@dataclass
class Prepared:
    head: dict  # what the worker (and so the candidate) gets
    part: dict | None = None  # test code for the judge process
    checks: list = field(default_factory=list)
    cases: list | None = None  # stdio: [(stdin, expected stdout)]
    error: SandboxResult | None = None  # decided without running anything
    key: str = ""
    deterministic: bool = False  # its verdict may be cached (see `deterministic`)


JOB_KEYS = ("code", "tests", "stdin", "expect", "timeout", "memory_mb", "entry_point", "prelude", "setup",
            "audit_hook")  # fmt: skip


def normalize(job, timeout: float, memory_mb: int) -> dict:
    """A job as a dict with validated fields; ValueError/TypeError naming what is wrong (an unknown key
    too: a misspelt setting must not be dropped without a word)."""
    if isinstance(job, dict):
        d = dict(job)
        unknown = sorted(str(k)[:40] for k in d if k not in JOB_KEYS)
        if unknown:
            raise UsageError(f"unknown job keys {unknown}; a job has {list(JOB_KEYS)}")
    else:
        t = tuple(job)
        if len(t) not in (2, 4):
            raise ValueError(
                "a job is (code, tests) or (code, tests, stdin, expect) or a dict with those keys"
            )
        d = dict(zip(("code", "tests", "stdin", "expect"), t))
    d.setdefault("tests", "")
    d.setdefault("stdin", None)
    d.setdefault("expect", None)
    d["timeout"], d["memory_mb"] = check_limits(d.get("timeout", timeout), d.get("memory_mb", memory_mb))
    if not isinstance(d.get("code"), str) or not isinstance(d["tests"], str):
        raise TypeError("job code and tests must be str")
    for k in ("stdin", "expect", "entry_point", "prelude", "setup"):
        if d.get(k) is not None and not isinstance(d[k], str):
            raise TypeError(f"job {k} must be str or None, got {type(d[k]).__name__}")
    if d.get("audit_hook") not in (None, True, False):
        raise TypeError("job audit_hook must be True, False or None")
    d["kind"] = test_kind(d["tests"])
    if d["stdin"] is not None and d["expect"] is None:
        raise UsageError("job stdin is given without expect: give both for a stdin/stdout case")
    if d["expect"] is not None and (d["kind"] != "python" or d["tests"].strip()):
        raise UsageError(
            "job has stdin/expect and tests too: a job is one kind of test (Python tests, a stdio or calls "
            "marker, or stdin/expect), never several (the others would be dropped)"
        )
    return d


def test_kind(tests: str) -> str:
    """ "stdio", "calls" or "python": a marker counts only as the whole first line (docs/sandbox.md); one
    anywhere else (after a blank line, indented, with more text) is a UsageError, never Python tests that
    would then assert nothing."""
    first = tests.split("\n", 1)[0].rstrip("\r")
    if first == STDIO_MARKER:
        return "stdio"
    if first == CALLS_MARKER:
        return "calls"
    at = tests.find(_MARKER_PREFIX)
    if at >= 0:
        line = tests.count("\n", 0, at) + 1
        raise UsageError(
            f"tests hold a marker ({_MARKER_PREFIX!r}) on line {line} that is not their whole first line; "
            f"a stdio or calls test starts with exactly {STDIO_MARKER!r} or {CALLS_MARKER!r} and a newline"
        )
    return "python"


_MARKER_PREFIX = "# marlflow:"


def _deployment() -> list:
    """The caller's sandbox switches (MARLFLOW_SANDBOX_*, read by new workers): part of the cache key."""
    return sorted((k, v) for k, v in os.environ.items() if k.startswith("MARLFLOW_SANDBOX_"))


def job_key(d: dict) -> str:
    """Everything that can change a verdict: every job field (the audit hook switch included) and the
    deployment switches."""
    fields = [d.get(k) for k in JOB_KEYS] + [_deployment()]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


class UsageError(ValueError):
    """A job that is wrong as given (raised to the caller, never a verdict)."""


def parse_tests(tests: str):
    """(tree, None) or (None, the exception) for test code; never raises (deep nesting included)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(tests), None
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return None, e


def _vacuous(tests: str, tree) -> bool:
    """True for tests with nothing to run: empty, blank, comments, docstrings, `pass`. Tests that do not
    parse are not empty: they are judged, and an `error` verdict says why they do not compile."""
    if not tests.strip():
        return True
    return tree is not None and all(
        isinstance(x, ast.Pass) or (isinstance(x, ast.Expr) and isinstance(x.value, ast.Constant))
        for x in tree.body
    )


def error(detail: str) -> SandboxResult:
    """The verdict of a job that could not be judged; `detail` says why."""
    return SandboxResult("error", False, detail=detail[:1000])


def prepare(job, timeout: float = 5.0, memory_mb: int = 1024) -> Prepared:
    """What the worker is sent for one job. A malformed job (wrong types, limits out of range, tests with
    nothing to run) raises ValueError/TypeError naming the field; anything else that goes wrong with
    this job's tests becomes its `error` verdict (p.error), never an exception."""
    d = normalize(job, timeout, memory_mb)
    python = d["kind"] == "python" and d["expect"] is None
    tree, parse_error = parse_tests(d["tests"]) if python else (None, None)
    if python and _vacuous(d["tests"], tree):
        raise ValueError(
            "job tests are empty (nothing but blanks, comments or docstrings): give asserts, or "
            "stdin/expect for a stdin/stdout case; an empty test would pass every program"
        )
    head = {"code": d["code"], "timeout": d["timeout"], "memory_mb": d["memory_mb"]}
    if d.get("audit_hook") is False:
        head["audit_hook"] = False  # only the kernel-layer test switches it off
    p = Prepared(head=head, key=job_key(d))
    try:
        p.deterministic = deterministic(d["code"], d["tests"], d.get("prelude") or "", d.get("setup") or "")
        _prepare(p, d, tree, parse_error)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - deep nesting, memory, a bug of ours: this job's verdict
        p.error = error(f"the tests cannot be prepared: {type(e).__name__}: {show(str(e), 300)}")
    return p


def _prepare(p: Prepared, d: dict, tree, parse_error) -> None:
    head, tests = p.head, d["tests"]
    if d["kind"] == "stdio" or d["expect"] is not None:
        head["mode"] = "stdio"
        if d["expect"] is not None:
            p.cases = [(d["stdin"] or "", d["expect"])]
            return
        try:
            cases = json.loads(tests[len(STDIO_MARKER) :])
        except (ValueError, TypeError, RecursionError) as e:
            p.error = error(f"bad stdio tests: {show(str(e), 300)}")
            return
        if type(cases) is not list or not all(
            type(c) is list and len(c) == 2 and type(c[0]) is str and type(c[1]) is str for c in cases
        ):
            raise UsageError("stdio tests are a JSON list of [stdin, expected stdout] pairs of strings")
        p.cases = [(i, o) for i, o in cases]
        if not p.cases:
            raise UsageError("job tests have no stdio cases: give at least one [stdin, expected stdout]")
        return
    head["mode"] = "calls"
    if d["kind"] == "calls":
        try:
            spec = json.loads(tests[len(CALLS_MARKER) :])
        except (ValueError, TypeError, RecursionError) as e:
            p.error = error(f"bad call tests: {show(str(e), 300)}")
            return
        # Shapes exactly as documented: arguments as a list (a string would be split into characters).
        if (
            type(spec) is not dict
            or type(spec.get("fn")) is not str
            or not spec["fn"].isidentifier()
            or type(spec.get("cases")) is not list
            or not all(type(c) is list and len(c) == 2 and type(c[0]) is list for c in spec["cases"])
        ):
            raise UsageError(
                'call tests are {"fn": NAME, "cases": [[ARGS, EXPECTED], ...]} with ARGS a JSON list of '
                "the positional arguments"
            )
        fn, cases = spec["fn"], spec["cases"]
        try:
            head["calls"] = [[fn, to_wire(a), {"t": "dict", "v": []}] for a, _ in cases]
            p.checks = [{"kind": "deep", "call": i, "expected": e} for i, (_, e) in enumerate(cases)]
        except (ValueError, TypeError, RecursionError) as e:
            p.error = error(f"bad call tests: {show(str(e), 300)}")
            return
        if not p.checks:
            raise UsageError("job tests have no call cases: give at least one [args, expected]")
        return
    if parse_error is not None:
        e = parse_error
        p.error = error(f"the tests do not compile: {type(e).__name__}: {show(str(e), 300)}")
        return
    conv = convert(tests, d.get("entry_point"), d["code"], tree=tree)
    if conv is not None:
        setup = "\n".join(x for x in (d.get("setup") or "", conv["setup"]) if x)
        head.update(calls=conv["calls"], setup=setup)
        p.checks = conv["checks"]
        return
    head["mode"] = "judge"
    if d.get("setup"):
        head["setup"] = d["setup"]
    p.part = {"tests": tests, "prelude": d.get("prelude") or "",
              "proxies": [d["entry_point"]] if d.get("entry_point") else []}  # fmt: skip


def _records(res: str):
    lines = res.split("\n")
    start = next((i for i, ln in enumerate(lines) if ln == "S"), None)
    trusted = lines if start is None else lines[:start]
    untrusted = [] if start is None else lines[start + 1 :]
    return start is not None, trusted, untrusted


def _err(lines, tag="E") -> dict | None:
    """The last well-formed `tag` record among `lines`, as a dict of plain fields (stage, type, msg: short
    str; line, errno: int or None). Records are untrusted after the `S` line: one that is too big, too
    deep or of the wrong shape is skipped, never decoded at any cost."""
    prefix = tag + "{"
    for ln in reversed(lines):  # from the end: a flood of records costs one decoding, not one each
        if ln.startswith(prefix):
            try:
                v = parse_record(ln[1:], 1 << 16)
            except ValueError:
                continue
            if isinstance(v, dict):
                return _fields(v)
    return None


def _fields(v: dict) -> dict:
    """The plain fields of an untrusted error record: stage, type, msg (str, cut) and line, errno (small
    int), each None when it is anything else."""
    out = {k: v[k][:500] if isinstance(v.get(k), str) else None for k in ("stage", "type", "msg")}
    out.update(
        {k: v[k] if type(v.get(k)) is int and abs(v[k]) < 1 << 31 else None for k in ("line", "errno")}
    )
    return out


def _is_memory(info: dict | None) -> bool:
    return bool(info) and (
        info.get("type") == "MemoryError"
        or (info.get("type") in ("OSError", "mmap.error") and info.get("errno") == 12)
    )


def _describe(info: dict) -> str:
    return f"{info.get('stage') or 'call'}: {info.get('type')}: {(info.get('msg') or '')[:300]} (line {info.get('line')})"


def verdict(p: Prepared, raw: dict, expect: str | None = None) -> SandboxResult:
    """The verdict for the worker's raw records; `error` (with the reason) if judging them fails."""
    try:
        return _verdict(p, raw, expect)
    except Exception as e:  # noqa: BLE001 - one job's records must never raise out of the caller
        return error(
            f"the caller could not judge this job's records: {type(e).__name__}: {show(str(e), 300)}"
        )


def _verdict(p: Prepared, raw: dict, expect: str | None = None) -> SandboxResult:
    if raw.get("error"):
        return error(f"the sandbox worker refused the job: {show(raw['error'], 300)}")
    stdout, stderr, seconds = raw.get("stdout", ""), raw.get("stderr", ""), float(raw.get("seconds", 0.0))

    def result(status: str, detail: str = "") -> SandboxResult:
        return SandboxResult(
            status, status == "passed", stdout[:OUTPUT_CAP], stderr[:OUTPUT_CAP], seconds, detail
        )

    st = raw.get("exit") or 0
    sig = os.WTERMSIG(st) if os.WIFSIGNALED(st) else 0
    code = os.WEXITSTATUS(st) if os.WIFEXITED(st) else -1
    jst = raw.get("judge_exit")
    jsig = os.WTERMSIG(jst) if jst is not None and os.WIFSIGNALED(jst) else 0
    started, trusted, untrusted = _records(raw.get("res", ""))
    if raw.get("timed_out") or signal.SIGXCPU in (sig, jsig):
        return result("timeout", f"over the {p.head['timeout']}s limit")
    if raw.get("over"):
        return result(
            "output_limit", f"{raw['over']} over the limit of {_LIMIT_OF.get(raw['over'], 0)} bytes"
        )
    terr = _err(trusted)
    if terr:
        if terr.get("stage") == "compile" and terr.get("type") in _SYNTAX:
            return result("syntax_error", f"{terr['type']}: {terr.get('msg')} (line {terr.get('line')})")
        return result("crashed", _describe(terr))
    if not started:
        return result("crashed", f"the sandbox did not start the program (exit status {st})")
    uerr = _err(untrusted)
    if _is_memory(uerr):
        return result("memory", f"{uerr.get('type')} in {uerr.get('stage')}")
    if sig:
        mem = sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT) and "Memory" in stderr
        return result("memory" if mem else "crashed", f"killed by signal {signal_name(sig)}")
    mode = p.head["mode"]
    if mode == "stdio":
        if code != 0 or uerr:
            return result("failed", _describe(uerr) if uerr else f"exited with code {code}")
        return (
            result("passed")
            if outputs_match(raw.get("stdout", ""), expect or "")
            else result("failed", "wrong output")
        )
    if uerr:
        return result("failed", _describe(uerr))
    if mode == "judge":
        v = raw.get("verdict", "")
        if (
            v == "PASS\n"
            and jst is not None
            and os.WIFEXITED(jst)
            and os.WEXITSTATUS(jst) == 0
            and "Y" in untrusted
        ):
            return result("passed")
        cinfo = _err(v.split("\n"), "C")
        if _is_memory(cinfo):
            return result("memory", f"{cinfo.get('type')} in a call")
        jerr = _err(v.split("\n"))
        if jerr and jerr.get("stage") == "refused":
            return result("error", f"{jerr.get('msg')} (line {jerr.get('line')})")
        if jerr and jerr.get("stage") in ("judge-setup", "tests-compile", "prelude"):
            return result("error", "the tests could not be run: " + _describe(jerr))
        if jsig:
            return result("crashed", f"judge killed by signal {signal_name(jsig)}")
        return result("failed", _describe(jerr) if jerr else f"the tests did not complete (exit {code})")
    rs = [ln[1:] for ln in untrusted if ln.startswith("R")]
    n = len(p.head.get("calls") or ())
    if len(rs) < n:
        return result("failed", f"exited with code {code} after {len(rs)} of {n} calls")
    for i, check in enumerate(p.checks):
        status, why = _check(check, rs)
        if status != "passed":
            prefix = f"AssertionError: test {i + 1} of {len(p.checks)}: " if status == "failed" else ""
            return result(status, prefix + why)
    return result("passed")


def _json_norm(v):
    try:
        return json.loads(json.dumps(v))
    except (TypeError, ValueError, RecursionError):
        return v


def _check(check: dict, rs: list[str]) -> tuple[str, str]:
    """(status, why) of one check against the candidate's answers `rs`: passed, failed, memory, or error
    (an answer over the decoding budget). Wrappers were applied in the candidate's process; here only
    plain, bounded data is compared."""
    kind = check["kind"]
    if kind == "const_false":
        return "failed", "a test asserts a false constant"
    try:
        tag, value = parse_record(rs[check["call"]])
        if tag == "err":
            info = _fields(value) if isinstance(value, dict) else {}
            if _is_memory(info):
                return "memory", f"{info.get('type')} in a call"
            return "failed", f"the call raised {info.get('type')}: {(info.get('msg') or '')[:200]}"
        if tag != "ok":
            return "failed", "malformed answer"
        got = from_wire(value)
    except Refused as e:
        return "error", f"the answer was refused: {show(str(e), 200)}"
    except (ValueError, TypeError, RecursionError, IndexError) as e:
        return "failed", f"the answer is not a plain builtin value ({show(str(e), 100)})"
    try:
        if kind == "deep":
            g = _json_norm(got)
            ok = g == check["expected"] or [g] == check["expected"]
        elif kind == "cmp":
            ok = bool(OPS[check["op"]](got, check["expected"]))
        elif kind == "truthy":
            ok = bool(got)
        elif kind == "falsy":
            ok = not got
        elif kind == "absdiff":
            d = abs(got - check["expected"])
            ok = d < check["tol"] if check["op"] == "Lt" else d <= check["tol"]
        elif kind == "isclose":
            kw = {k: check[k] for k in ("rel_tol", "abs_tol") if k in check}
            ok = math.isclose(got, check["expected"], **kw)
        else:
            return "failed", f"unknown check {kind}"
    except Exception as e:  # noqa: BLE001 - comparing plain data; a TypeError is a wrong answer
        return "failed", f"{type(e).__name__} comparing the answer: {show(str(e), 100)}"
    return ("passed", "") if ok else ("failed", f"got {show(got, 200)}")
