"""Constants, the result type, limit validation and the strict value encoding (imported first: no side effects).

The strict encoding is how values cross between the trusted side and the candidate process. Only exact
builtin types are encoded (`type(v) is int`, never a subclass); containers are tagged so a tuple stays a
tuple. Decoding is strict too: anything that is not a well-formed encoding is an error, and what comes
out is plain builtin data whose `==` the candidate did not write.
"""

from __future__ import annotations

import collections
import json
import math
from dataclasses import asdict, dataclass

STATUSES = ("passed", "failed", "timeout", "memory", "crashed", "syntax_error", "output_limit")
STDIO_MARKER = "# marlflow: stdio"
CALLS_MARKER = "# marlflow: calls"
SANDBOX_UID = 65534  # "nobody"; used only when the supervisor runs as root
OUTPUT_CAP = 64 * 1024  # bytes of stdout/stderr kept in a result for display
STDOUT_LIMIT = 4 * 1024 * 1024  # stdout is judged whole up to this; above it the status is output_limit
RESULT_LIMIT = 4 * 1024 * 1024  # bytes of encoded return values a program may send back
STDERR_LIMIT = 8 * 1024 * 1024  # a program writing more stderr than this is killed (output_limit)
MAX_TIMEOUT = 600.0  # seconds; a job may ask for less, never for more
MAX_MEMORY_MB = 256 * 1024
TMP_PREFIX = "marlflow-sbx-"
WORKDIR_MB = 64  # size of the per-program tmpfs working directory
MAX_DEPTH = 100  # nesting depth of an encoded value
MAX_ITEMS = 1_000_000  # items drawn from a returned iterator


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


def check_limits(timeout, memory_mb) -> tuple[float, int]:
    """Validated (timeout seconds, memory MiB); ValueError naming the bad value and what is allowed."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {timeout!r}")
    t = float(timeout)
    if not math.isfinite(t) or t <= 0 or t > MAX_TIMEOUT:
        raise ValueError(f"timeout must be finite, > 0 and <= {MAX_TIMEOUT:g} seconds, got {timeout!r}")
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int | float) or memory_mb != memory_mb:
        raise ValueError(
            f"memory_mb must be an integer number of MiB in [1, {MAX_MEMORY_MB}], got {memory_mb!r}"
        )
    if int(memory_mb) != memory_mb or not 1 <= memory_mb <= MAX_MEMORY_MB:
        raise ValueError(
            f"memory_mb must be an integer number of MiB in [1, {MAX_MEMORY_MB}], got {memory_mb!r}"
        )
    return t, int(memory_mb)


# ------------------------------------------------------------------------------------- strict encoding

_TYPES = {t.__name__: t for t in (int, float, str, bool, list, tuple, dict, set, frozenset, bytes, complex)}
_TYPES["NoneType"] = type(None)
_DICTS = (collections.Counter, collections.defaultdict, collections.OrderedDict)
_ITERS = tuple(
    {type(x) for x in (iter([]), iter(()), iter(""), iter(range(0)), iter({}), (i for i in ()),
                       map(int, ()), filter(None, ()), zip(), enumerate(()), reversed([]))}
)  # fmt: skip


def to_wire(v, depth: int = 0):
    """JSON-able form of `v`; TypeError for anything but exact builtin values."""
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if t is list:
        return [to_wire(x, d) for x in v]
    if t is tuple or t is set or t is frozenset:
        return {"t": t.__name__, "v": [to_wire(x, d) for x in v]}
    if t is dict or t in _DICTS:
        # collections' dict types go as plain dicts: their contents, read with dict's own methods.
        return {"t": "dict", "v": [[to_wire(k, d), to_wire(x, d)] for k, x in dict.items(v)]}
    if t is bytes or t is bytearray:
        return {"t": t.__name__, "v": v.hex()}
    if t is complex:
        return {"t": "complex", "v": [v.real, v.imag]}
    if t is range:
        return {"t": "range", "v": [v.start, v.stop, v.step]}
    if t is type and any(v is x for x in _TYPES.values()):
        return {"t": "type", "v": v.__name__}
    if t in _ITERS:
        items = []
        for x in v:
            if len(items) >= MAX_ITEMS:
                raise ValueError(f"iterator longer than {MAX_ITEMS} items")
            items.append(to_wire(x, d))
        return {"t": "iter", "v": items}
    raise TypeError(
        f"{t.__module__}.{t.__qualname__} is not a plain builtin value (exact builtin types only)"
    )


def from_wire(x, depth: int = 0, refs: dict | None = None):
    """Inverse of `to_wire`; ValueError for anything malformed. `refs` resolves {"t": "ref"} (args only)."""
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if depth > MAX_DEPTH + 2:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if t is list:
        return [from_wire(e, d, refs) for e in x]
    if t is not dict or set(x) != {"t", "v"}:
        raise ValueError(f"malformed value: {type(x).__name__}")
    tag, v = x["t"], x["v"]
    if tag in ("tuple", "set", "frozenset", "iter") and type(v) is list:
        items = [from_wire(e, d, refs) for e in v]
        return (
            iter(items) if tag == "iter" else {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        )
    if tag == "dict" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
        return {from_wire(k, d, refs): from_wire(e, d, refs) for k, e in v}
    if tag in ("bytes", "bytearray") and type(v) is str:
        return (bytes if tag == "bytes" else bytearray).fromhex(v)
    if tag == "complex" and type(v) is list and len(v) == 2 and all(type(e) in (int, float) for e in v):
        return complex(v[0], v[1])
    if tag == "range" and type(v) is list and len(v) == 3 and all(type(e) is int for e in v):
        return range(*v)
    if tag == "type" and type(v) is str and v in _TYPES:
        return _TYPES[v]
    if tag == "ref" and refs is not None and type(v) is str and v in refs:
        return refs[v]
    if tag == "new" and refs is not None and type(v) is list and len(v) == 2 and v[0] in refs:
        return refs[v[0]](*from_wire(v[1], d, refs))  # an argument the program's own class builds
    raise ValueError(f"malformed value with tag {str(tag)[:40]!r}")


def dumps(v) -> str:
    return json.dumps(to_wire(v), separators=(",", ":"))


def loads(s: str):
    try:
        return from_wire(json.loads(s))
    except RecursionError as e:
        raise ValueError("value nested too deeply") from e
