"""Constants, the result type, limit validation and the strict value encoding (imported first: no side effects).

The strict encoding is how values cross between the trusted side and the candidate process. Only exact
builtin types are encoded (`type(v) is int`, never a subclass); containers are tagged so a tuple stays a
tuple. Decoding is strict too: anything that is not a well-formed encoding is an error, and what comes
out is plain builtin data whose `==` the candidate did not write.
"""

from __future__ import annotations

import ast
import collections
import itertools
import json
import math
import re
import reprlib
import signal
from dataclasses import asdict, dataclass

# `error`: the job could not be judged (tests that do not compile or nest too deeply, an answer over the
# caller's decoding budget, a failure of the caller's own code); the detail says why. Never `passed`.
STATUSES = ("passed", "failed", "timeout", "memory", "crashed", "syntax_error", "output_limit", "error")
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
WORKDIR_INODES = 4096  # files and directories in it
TASKS = 64  # RLIMIT_NPROC of a candidate: its threads, counted per job (docs/sandbox.md)
SANDBOX_UID_BASE = (
    1 << 30
)  # + the worker's pid: each worker's candidates run as a uid of their own (root only)
MAX_DEPTH = 100  # nesting depth of an encoded value
MAX_ITEMS = 1_000_000  # items drawn from a returned iterator
# Caller-side decoding budget for one encoded answer (RESULT_LIMIT bytes at most): containers allowed
# (a JSON `[` or `{`, counted before anything is built, bounds memory to tens of MB) and distinct keys of
# one dict/set that may share a hash (same-hash keys make each insertion probe all the others: quadratic).
MAX_CONTAINERS = 200_000
MAX_SAME_HASH = 64


@dataclass(frozen=True)
class SandboxResult:
    """Verdict of one job. `passed` is True only when every test ran and succeeded."""

    status: str
    passed: bool
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    detail: str = ""

    def __post_init__(self):
        # Text from the program (an exception message with a lone surrogate) must not make printing or
        # writing a verdict fail: unencodable characters become "?".
        for name in ("stdout", "stderr", "detail"):
            text = getattr(self, name)
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                object.__setattr__(self, name, text.encode("utf-8", "replace").decode("utf-8"))

    def to_dict(self) -> dict:
        return asdict(self)


def stdio_tests(cases) -> str:
    """Encode stdin/stdout cases [(stdin, expected_stdout), ...] as a `tests` string."""
    return STDIO_MARKER + "\n" + json.dumps([[str(i), str(o)] for i, o in cases])


def outputs_match(got: str, expected: str) -> bool:
    """Whitespace-insensitive line comparison, the usual rule for competitive-programming judges: the
    non-blank lines (str.splitlines' line breaks), each as its whitespace-separated words, are equal.
    One line at a time: the caller's memory is the longest line, not a list per line (4 MiB of short
    lines were hundreds of MiB as lists)."""
    return all(a == b for a, b in itertools.zip_longest(_words(got), _words(expected)))


_LINE = re.compile(r"[^\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]+")  # str.splitlines' breaks


def _words(text: str):
    for m in _LINE.finditer(text):
        words = m.group().split()
        if words:
            yield words


def check_limits(timeout, memory_mb) -> tuple[float, int]:
    """Validated (timeout seconds, memory MiB); ValueError naming the bad value and what is allowed (also
    for values no float can hold, such as 10**400, which are compared as ints and never converted)."""
    bad_t = f"timeout must be finite, > 0 and <= {MAX_TIMEOUT:g} seconds, got {_short(timeout)}"
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ValueError(bad_t)
    if not (isinstance(timeout, int) or math.isfinite(timeout)) or not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(bad_t)
    bad_m = f"memory_mb must be an integer number of MiB in [1, {MAX_MEMORY_MB}], got {_short(memory_mb)}"
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int | float):
        raise ValueError(bad_m)
    if not (isinstance(memory_mb, int) or (math.isfinite(memory_mb) and memory_mb.is_integer())):
        raise ValueError(bad_m)
    if not 1 <= memory_mb <= MAX_MEMORY_MB:
        raise ValueError(bad_m)
    return float(timeout), int(memory_mb)


def _short(v) -> str:
    return show(v, 60)


def show(v, limit: int = 200) -> str:
    """repr(v) cut to `limit` characters, for any value: never raises (ints past the str-conversion limit,
    deep nesting, a failing __repr__ give a placeholder) and never builds more than ~limit characters."""
    r = reprlib.Repr()  # (keyword arguments only from Python 3.12)
    r.maxlevel, r.maxstring, r.maxlong, r.maxother = 6, limit, limit, limit
    try:
        if type(v) is int and v.bit_length() > 4 * limit:
            return f"<int of {v.bit_length()} bits>"
        text = r.repr(v)
    except Exception:  # noqa: BLE001 - e.g. a huge int nested in a list: show its type only
        text = f"<{type(v).__name__}>"
    return text[:limit]


def signal_name(n) -> str:
    """SIGKILL for 9; the number itself for one the signal module has no name for (most real-time ones)."""
    try:
        return signal.Signals(n).name
    except (ValueError, TypeError):
        return show(n, 20)


# Builtins a converted assert may wrap around a call (`assert sorted(f(x)) == [...]`). They are applied in
# the candidate's process, under its limits, never by the caller (`sum(range(10**18))` is the program's
# time, not the trainer's).
WRAPPER_NAMES = ("set", "frozenset", "sorted", "tuple", "list", "len", "abs", "round", "float", "int", "str",
                 "bool", "sum", "min", "max", "dict")  # fmt: skip


_BLOCKS = ("body", "orelse", "finalbody", "handlers")


def module_names(tree: ast.AST, loads: bool = True) -> tuple[collections.Counter, set[str]]:
    """(how often each name is loaded, anywhere; names bound in the module's own scope) of parsed test
    code. A name bound only inside a function (an argument, a local) is not a module name; `global x` in
    a function binds x, and so does `x := ...` anywhere (conservatively). With loads=False only the
    statements are read (no walk over every expression: fast) and the counter is empty; `:=` is missed."""
    counts: collections.Counter = collections.Counter()
    bound: set[str] = set()
    for n in ast.walk(tree) if loads else ():
        if type(n) is ast.Name and type(n.ctx) is ast.Load:
            counts[n.id] += 1
        elif type(n) is ast.NamedExpr and type(n.target) is ast.Name:
            bound.add(n.target.id)
    todo = [(getattr(tree, "body", []), True)]  # statement lists: (statements, in the module's scope)
    while todo:
        body, top = todo.pop()
        for st in body:
            t = type(st)
            if t in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef):
                if top:
                    bound.add(st.name)
                todo.append((st.body, False))  # only for `global`
                continue
            if t is ast.Global:
                bound.update(st.names)
            elif top:
                targets = []
                if t is ast.Assign:
                    targets = st.targets
                elif t in (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor):
                    targets = [st.target]
                elif t in (ast.With, ast.AsyncWith):
                    targets = [i.optional_vars for i in st.items if i.optional_vars is not None]
                elif t in (ast.Import, ast.ImportFrom):
                    bound.update((a.asname or a.name).split(".")[0] for a in st.names)
                elif t is ast.ExceptHandler and st.name:
                    bound.add(st.name)
                for tg in targets:
                    bound.update(x.id for x in ast.walk(tg) if type(x) is ast.Name)
            todo.extend((getattr(st, f), top) for f in _BLOCKS if isinstance(getattr(st, f, None), list))
    return counts, bound


# ------------------------------------------------------------------------------------- strict encoding

_TYPES = {t.__name__: t for t in (int, float, str, bool, list, tuple, dict, set, frozenset, bytes, complex)}
_TYPES["NoneType"] = type(None)
_DICTS = (collections.Counter, collections.defaultdict, collections.OrderedDict)
_ITERS = tuple(
    {type(x) for x in (iter([]), iter(()), iter(""), iter(range(0)), iter({}), (i for i in ()),
                       map(int, ()), filter(None, ()), zip(), enumerate(()), reversed([]))}
)  # fmt: skip


_BUILTIN_BASES = (int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset, range)
_SHARED = (list, tuple, set, frozenset, dict, bytearray, *_DICTS)  # containers whose identity can be kept
_DICT_TAGS = {dict: "dict", collections.Counter: "Counter", collections.OrderedDict: "OrderedDict",
              collections.defaultdict: "defaultdict"}  # fmt: skip
_PENDING = object()  # a tuple/frozenset being decoded: referring to it from inside is malformed


class Handles:
    """Objects of the program that are not plain builtin values (instances of its own classes, functions,
    bound methods; never a subclass of a builtin type, whose instances stay "not a plain builtin value"),
    crossing the judge's pipes as {"t": "obj", "v": number}. In the candidate (`make` None) a number
    stands for the object itself, kept for the whole job; in the judge for a stand-in, `make(number)`,
    one per number, so `is` between stand-ins is the program's identity (`_child._Remote`)."""

    LIMIT = 100_000

    def __init__(self, make=None):
        self.make, self.objs, self.ids = make, {}, {}

    def number(self, v) -> int:
        """`v`'s number (a new one for an object the candidate meets first); TypeError in the judge for
        anything but a stand-in."""
        k = self.ids.get(id(v))
        if k is not None and self.objs.get(k) is v:
            return k
        t = type(v)
        if self.make is not None or isinstance(v, _BUILTIN_BASES):
            raise TypeError(
                f"{t.__module__}.{t.__qualname__} is not a plain builtin value (exact builtin types only)"
            )
        if len(self.objs) >= self.LIMIT:
            raise ValueError(f"more than {self.LIMIT} objects of the program crossed")
        k = self.ids[id(v)] = len(self.objs)
        self.objs[k] = v
        return k

    def get(self, k):
        """The object (candidate) or stand-in (judge) numbered `k`; ValueError if malformed."""
        if type(k) is not int or not 0 <= k < self.LIMIT or (self.make is None and k not in self.objs):
            raise ValueError("malformed object number")
        o = self.objs.get(k)
        if o is None:
            o = self.objs[k] = self.make(k)
            self.ids[id(o)] = k
        return o


class _Nodes(list):
    """`Shared.objs`: the numbered containers, and the exchange's `Handles` (None outside the judge's
    pipes) for `from_wire`, which gets only this list."""

    __slots__ = ("handles",)


class Shared:
    """Identity across one exchange: every container `to_wire` meets gets the next number (in pre-order);
    a container met again is sent as {"t": "same", "v": number}, so aliasing, cycles and `is` survive.
    `from_wire(..., nodes=...)` numbers containers in the same order. `ids` maps id() to the number and
    `objs` keeps those objects alive (so no id is reused while the numbers are in use). With `handles`,
    other objects cross as numbers (`Handles`) instead of being a TypeError."""

    def __init__(self, objs=(), handles: Handles | None = None):
        self.objs: list = _Nodes()
        self.objs.handles = handles
        self.ids: dict[int, int] = {}
        for o in objs:
            self.add(o)

    def add(self, o) -> int:
        self.ids[id(o)] = len(self.objs)
        self.objs.append(o)
        return len(self.objs) - 1


def to_wire(v, depth: int = 0, memo: Shared | None = None):
    """JSON-able form of `v`; TypeError for anything but exact builtin values. With `memo`, containers
    already sent in this exchange go as references (see `Shared`)."""
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if memo is not None and t in _SHARED:
        k = memo.ids.get(id(v))
        if k is not None:
            return {"t": "same", "v": k}
        memo.add(v)
    if t is list:
        return [to_wire(x, d, memo) for x in v]
    if t is tuple or t is set or t is frozenset:
        return {"t": t.__name__, "v": [to_wire(x, d, memo) for x in v]}
    if t is dict or t in _DICTS:
        # Read with the exact types' own methods (an OrderedDict's order is its own, not its storage's);
        # collections' types keep their type, so `==` between two of them is what Python's is.
        pairs = collections.OrderedDict.items(v) if t is collections.OrderedDict else dict.items(v)
        out = {"t": _DICT_TAGS[t], "v": [[to_wire(k, d, memo), to_wire(x, d, memo)] for k, x in pairs]}
        if t is collections.defaultdict:
            f = v.default_factory
            out["f"] = f.__name__ if any(f is x for x in _TYPES.values()) else None
        return out
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
            items.append(to_wire(x, d, memo))
        return {"t": "iter", "v": items}
    if memo is not None and memo.objs.handles is not None:
        return {"t": "obj", "v": memo.objs.handles.number(v)}
    raise TypeError(
        f"{t.__module__}.{t.__qualname__} is not a plain builtin value (exact builtin types only)"
    )


_DICT_TYPES = {tag: t for t, tag in _DICT_TAGS.items()}


class Refused(ValueError):
    """An untrusted record or value over the decoding budget: refused before it is built."""


def _hashable(items: list, what: str) -> list:
    """`items` unchanged, or ValueError when more than MAX_SAME_HASH of them share one hash: building a
    dict or set of them would cost the decoder time quadratic in their number."""
    if len(items) > MAX_SAME_HASH:
        try:
            worst = max(collections.Counter(map(hash, items)).values())
        except TypeError as e:
            raise ValueError(f"unhashable {what}: {e}") from None
        if worst > MAX_SAME_HASH:
            raise Refused(f"{worst} {what}s share one hash (limit {MAX_SAME_HASH}); refused, not built")
    return items


def from_wire(x, depth: int = 0, refs: dict | None = None, nodes: list | None = None):
    """Inverse of `to_wire`; ValueError for anything malformed. `refs` resolves {"t": "ref"} (args only);
    `nodes` (a list, filled in pre-order) resolves {"t": "same"} as `Shared` numbered them. A dict or set
    whose keys share hashes is refused before it is built (`_hashable`)."""
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if depth > MAX_DEPTH + 2:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if t is list:
        if nodes is None:
            return [from_wire(e, d, refs) for e in x]
        out: list = []
        nodes.append(out)
        out.extend([from_wire(e, d, refs, nodes) for e in x])
        return out
    if t is not dict or not (set(x) == {"t", "v"} or (set(x) == {"t", "v", "f"} and x["t"] == "defaultdict")):
        raise ValueError(f"malformed value: {type(x).__name__}")
    tag, v = x["t"], x["v"]
    if tag == "same" and nodes is not None and type(v) is int and 0 <= v < len(nodes):
        if nodes[v] is _PENDING:
            raise ValueError("a tuple or frozenset that contains itself")
        return nodes[v]
    if tag in ("tuple", "set", "frozenset", "iter") and type(v) is list:
        slot = -1
        if nodes is not None and tag != "iter":
            slot = len(nodes)
            nodes.append(set() if tag == "set" else _PENDING)
        items = [from_wire(e, d, refs, nodes) for e in v]
        if tag == "iter":
            return iter(items)
        if tag == "tuple":
            out = tuple(items)
        else:
            _hashable(items, "set item")
            out = nodes[slot] if tag == "set" and slot >= 0 else set()
            out.update(items)
            out = frozenset(out) if tag == "frozenset" else out
        if slot >= 0:
            nodes[slot] = out
        return out
    if tag in _DICT_TYPES and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
        if tag == "defaultdict":
            f = x.get("f")
            out = collections.defaultdict(_TYPES[f] if type(f) is str and f in _TYPES else None)
        else:
            out = _DICT_TYPES[tag]()
        if nodes is not None:
            nodes.append(out)
        pairs = [(from_wire(k, d, refs, nodes), from_wire(e, d, refs, nodes)) for k, e in v]
        _hashable([k for k, _ in pairs], "dict key")
        if type(out) is collections.OrderedDict:
            for k, e in pairs:  # (dict.update would bypass its order)
                out[k] = e
        else:
            dict.update(out, pairs)  # (Counter.update would count the pairs)
        return out
    if tag in ("bytes", "bytearray") and type(v) is str:
        out = (bytes if tag == "bytes" else bytearray).fromhex(v)
        if nodes is not None and tag == "bytearray":
            nodes.append(out)
        return out
    if tag == "complex" and type(v) is list and len(v) == 2 and all(type(e) in (int, float) for e in v):
        return complex(v[0], v[1])
    if tag == "range" and type(v) is list and len(v) == 3 and all(type(e) is int for e in v):
        return range(*v)
    if tag == "type" and type(v) is str and v in _TYPES:
        return _TYPES[v]
    if tag == "obj" and getattr(nodes, "handles", None) is not None:
        return nodes.handles.get(v)
    if tag == "ref" and refs is not None and type(v) is str and v in refs:
        return refs[v]
    if tag == "new" and refs is not None and type(v) is list and len(v) == 2 and v[0] in refs:
        return refs[v[0]](*from_wire(v[1], d, refs))  # an argument the program's own class builds
    raise ValueError(f"malformed value with tag {str(tag)[:40]!r}")


def parse_record(text: str, limit: int = RESULT_LIMIT + 64):
    """json.loads of one untrusted record within a budget, checked before anything is built: at most
    `limit` characters and MAX_CONTAINERS brackets; ValueError otherwise (also for nesting too deep
    for the JSON decoder, which raises RecursionError)."""
    if len(text) > limit:
        raise Refused(f"record over {limit} characters")
    n = text.count("[") + text.count("{")
    if n > MAX_CONTAINERS:
        raise Refused(f"record with {n} containers (limit {MAX_CONTAINERS}); refused, not decoded")
    try:
        return json.loads(text)
    except RecursionError:
        raise Refused("record nested too deeply for the JSON decoder") from None


def dumps(v) -> str:
    return json.dumps(to_wire(v), separators=(",", ":"))


def loads(s: str):
    try:
        return from_wire(parse_record(s))
    except RecursionError as e:
        raise ValueError("value nested too deeply") from e
