"""Jobs as the caller gives them -> what the worker is sent, and the worker's raw records -> a verdict.

Runs in the caller's (trusted) process: the expected values, expected stdout and the comparison live
only here. The worker and the candidate get the program, the call arguments or stdin, and limits.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import signal
from dataclasses import dataclass, field

from marlflow.sandbox._convert import OPS, WRAPPERS, convert
from marlflow.sandbox._result import (
    CALLS_MARKER,
    OUTPUT_CAP,
    RESULT_LIMIT,
    STDERR_LIMIT,
    STDIO_MARKER,
    STDOUT_LIMIT,
    SandboxResult,
    check_limits,
    from_wire,
    outputs_match,
    to_wire,
)

_SYNTAX = ("SyntaxError", "IndentationError", "TabError")
_LIMIT_OF = {"stdout": STDOUT_LIMIT, "stderr": STDERR_LIMIT, "results": RESULT_LIMIT}


@dataclass
class Prepared:
    head: dict  # what the worker (and so the candidate) gets
    part: dict | None = None  # test code for the judge process
    checks: list = field(default_factory=list)
    cases: list | None = None  # stdio: [(stdin, expected stdout)]
    error: SandboxResult | None = None  # decided without running anything
    key: str = ""


def normalize(job, timeout: float, memory_mb: int) -> dict:
    """A job as a dict with validated fields; ValueError/TypeError naming what is wrong."""
    if isinstance(job, dict):
        d = dict(job)
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
    return d


def job_key(d: dict) -> str:
    fields = ("code", "tests", "stdin", "expect", "timeout", "memory_mb", "entry_point", "prelude", "setup")
    return hashlib.sha256(json.dumps([d.get(k) for k in fields]).encode()).hexdigest()


def prepare(job, timeout: float = 5.0, memory_mb: int = 1024) -> Prepared:
    d = normalize(job, timeout, memory_mb)
    head = {"code": d["code"], "timeout": d["timeout"], "memory_mb": d["memory_mb"]}
    if d.get("audit_hook") is False:
        head["audit_hook"] = False  # only the kernel-layer test switches it off
    p = Prepared(head=head, key=job_key(d))
    tests = d["tests"]
    if tests.startswith(STDIO_MARKER) or d["expect"] is not None:
        head["mode"] = "stdio"
        if d["expect"] is not None:
            p.cases = [(d["stdin"] or "", d["expect"])]
            return p
        try:
            cases = json.loads(tests[len(STDIO_MARKER) :])
            p.cases = [(str(i), str(o)) for i, o in cases]
        except (ValueError, TypeError) as e:
            p.error = SandboxResult("crashed", False, detail=f"bad stdio tests: {e}")
            return p
        if not p.cases:
            p.error = SandboxResult("crashed", False, detail="no test cases")
        return p
    head["mode"] = "calls"
    if tests.startswith(CALLS_MARKER):
        try:
            spec = json.loads(tests[len(CALLS_MARKER) :])
            fn, cases = str(spec["fn"]), spec["cases"]
            head["calls"] = [[fn, to_wire(list(a)), {"t": "dict", "v": []}] for a, _ in cases]
            p.checks = [{"kind": "deep", "call": i, "expected": e} for i, (_, e) in enumerate(cases)]
        except (ValueError, TypeError, KeyError) as e:
            p.error = SandboxResult("crashed", False, detail=f"bad call tests: {e}")
        return p
    conv = convert(tests, d.get("entry_point"), d["code"])
    if conv is not None:
        setup = "\n".join(x for x in (d.get("setup") or "", conv["setup"]) if x)
        head.update(calls=conv["calls"], setup=setup)
        p.checks = conv["checks"]
        return p
    try:
        ast.parse(tests)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        p.error = SandboxResult("crashed", False, detail=f"the tests do not compile: {e}")
        return p
    head["mode"] = "judge"
    if d.get("setup"):
        head["setup"] = d["setup"]
    p.part = {"tests": tests, "prelude": d.get("prelude") or "",
              "proxies": [d["entry_point"]] if d.get("entry_point") else []}  # fmt: skip
    return p


def _records(res: str):
    lines = res.split("\n")
    start = next((i for i, ln in enumerate(lines) if ln == "S"), None)
    trusted = lines if start is None else lines[:start]
    untrusted = [] if start is None else lines[start + 1 :]
    return start is not None, trusted, untrusted


def _err(lines, tag="E") -> dict | None:
    found = None
    for ln in lines:
        if ln.startswith(tag + "{"):
            try:
                v = json.loads(ln[1:])
            except ValueError:
                continue
            if isinstance(v, dict):
                found = v
    return found


def _is_memory(info: dict | None) -> bool:
    return bool(info) and (
        info.get("type") == "MemoryError"
        or (info.get("type") in ("OSError", "mmap.error") and info.get("errno") == 12)
    )


def _describe(info: dict) -> str:
    return f"{info.get('stage', 'call')}: {info.get('type')}: {str(info.get('msg'))[:300]} (line {info.get('line')})"


def verdict(p: Prepared, raw: dict, expect: str | None = None) -> SandboxResult:
    if raw.get("error"):
        return SandboxResult("crashed", False, detail=f"sandbox worker refused the job: {raw['error']}")
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
        return result("memory" if mem else "crashed", f"killed by signal {signal.Signals(sig).name}")
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
        if jerr and jerr.get("stage") in ("judge-setup", "tests-compile", "prelude"):
            return result("crashed", _describe(jerr))
        if jsig:
            return result("crashed", f"judge killed by signal {signal.Signals(jsig).name}")
        return result("failed", _describe(jerr) if jerr else f"the tests did not complete (exit {code})")
    rs = [ln[1:] for ln in untrusted if ln.startswith("R")]
    n = len(p.head.get("calls") or ())
    if len(rs) < n:
        return result("failed", f"exited with code {code} after {len(rs)} of {n} calls")
    for i, check in enumerate(p.checks):
        ok, why = _check(check, rs)
        if ok is None:
            return result("memory", why)
        if not ok:
            return result("failed", f"AssertionError: test {i + 1} of {len(p.checks)}: {why}")
    return result("passed")


def _json_norm(v):
    try:
        return json.loads(json.dumps(v))
    except (TypeError, ValueError):
        return v


def _check(check: dict, rs: list[str]):
    """(True, "") / (False, why) / (None, why) for memory."""
    kind = check["kind"]
    if kind == "const_false":
        return False, "a test asserts a false constant"
    try:
        tag, value = json.loads(rs[check["call"]])
        if tag == "err":
            info = value if isinstance(value, dict) else {}
            if _is_memory(info):
                return None, f"{info.get('type')} in a call"
            return False, f"the call raised {info.get('type')}: {str(info.get('msg'))[:200]}"
        if tag != "ok":
            return False, "malformed answer"
        got = from_wire(value)
    except (ValueError, TypeError, RecursionError, IndexError) as e:
        return False, f"the answer is not a plain builtin value ({str(e)[:100]})"
    try:
        for name, extra, kw in check.get("wrappers") or ():
            got = WRAPPERS[name](got, *extra, **kw)
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
            return False, f"unknown check {kind}"
    except Exception as e:  # noqa: BLE001 - comparing plain data; a TypeError is a wrong answer
        return False, f"{type(e).__name__} comparing the answer: {str(e)[:100]}"
    return bool(ok), "" if ok else f"got {repr(got)[:200]}"
