"""Test code -> (call, expected) pairs, by an AST pass; run in the trusted caller, never in the sandbox.

A test converts when every statement is an assert of one of these shapes, where CALL is a call of a
function the program defines (under `check(candidate)`, `candidate` is the entry point) with constant
arguments, optionally wrapped in set/frozenset/sorted/tuple/list/len/abs/round/float/int/str/bool/sum/
min/max/dict, and C is a constant expression (literals, arithmetic, those builtins, `math` constants):

    assert CALL <op> C  /  assert C <op> CALL      (==, !=, <, <=, >, >=, in, not in, is True/False/None)
    assert CALL  /  assert not CALL
    assert abs(CALL - C) < TOL  (or <=, either order)
    assert math.isclose(CALL, C, rel_tol=..., abs_tol=...)

plus constant `NAME = C` assignments, constant asserts, docstrings, `def check(candidate)` with such a
body called as `check(NAME)`, and a leading setup block (MBPP `test_setup_code`) whose names may be
passed as arguments: the setup runs in the candidate process after the solution, so it must not hold
expected values (expected values may only be constants). The candidate process receives only the
calls, each with its wrappers (applied there, to the real return value, under the program's limits);
the expected values and the comparison stay here. A name the tests bind in their own module scope
(a helper, a constant, an import) is never taken as the program's, and a mutable constant the tests
name again after passing it (`a = [3, 1]; assert f(a) == a`) is left to the judge, where the program's
changes to it are seen. Anything else is judged by the fallback: the test code runs in a separate
judge process (see `_child.judge`).
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
import warnings

from marlflow.sandbox._result import WRAPPER_NAMES, module_names, to_wire

WRAPPERS = {name: getattr(builtins, name) for name in WRAPPER_NAMES}  # for constants; calls: in the candidate
CONST_FUNCS = dict(WRAPPERS, range=range, pow=pow, complex=complex, bytes=bytes, chr=chr, ord=ord,
                   reversed=lambda x: list(reversed(x)), any=any, all=all)  # fmt: skip
MATH = {"pi": math.pi, "e": math.e, "inf": math.inf, "tau": math.tau, "sqrt": math.sqrt, "floor": math.floor,
        "ceil": math.ceil, "fabs": math.fabs, "factorial": math.factorial, "gcd": math.gcd, "log": math.log,
        "exp": math.exp, "pow": math.pow, "comb": math.comb, "isqrt": math.isqrt}  # fmt: skip
TYPES = {t.__name__: t for t in (int, float, str, bool, list, tuple, dict, set, frozenset, bytes, complex)}
_BUILTIN_NAMES = set(dir(builtins))
_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.BitAnd: operator.and_,
        ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.LShift: operator.lshift, ast.RShift: operator.rshift}  # fmt: skip
_UN = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert}
OPS = {"Eq": operator.eq, "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le, "Gt": operator.gt,
       "GtE": operator.ge, "In": lambda a, b: a in b, "NotIn": lambda a, b: a not in b, "Is": operator.is_}  # fmt: skip
_FLIP = {"Eq": "Eq", "NotEq": "NotEq", "Lt": "Gt", "LtE": "GtE", "Gt": "Lt", "GtE": "LtE", "Is": "Is"}


class NotConvertible(Exception):
    pass


# The caller's work on constants is linear in the tests' text with a hard cap: no value it builds holds
# more than MAX_CONST_LEN items (or an int of more than MAX_CONST_BITS bits), and the values of one
# job's calls and expected values hold at most MAX_JOB_ITEMS items in all (`_Walk`). Tests over a cap
# are not converted: they run in the judge process, under the program's limits.
MAX_CONST_LEN = 100_000
MAX_CONST_BITS = 1 << 16
MAX_JOB_ITEMS = 300_000
_SIZED = (str, bytes, list, tuple, set, frozenset, dict, range)
_CONSUMERS = frozenset({"set", "frozenset", "sorted", "tuple", "list", "sum", "min", "max", "dict", "any",
                        "all", "reversed", "bytes", "str"})  # fmt: skip


def _bounded(v):
    """`v`, or NotConvertible when it is over the caps above."""
    if isinstance(v, _SIZED) and len(v) > MAX_CONST_LEN:
        _no()
    if type(v) is int and v.bit_length() > MAX_CONST_BITS:
        _no()
    return v


def items(v, budget: int) -> int:
    """Items (containers and scalars) in value `v`, counting stops past `budget` (so the cost is
    bounded by the budget, whatever `v` is: a list repeated by reference counts each time)."""
    n, todo = 0, [v]
    while todo and n <= budget:
        x = todo.pop()
        n += 1
        if type(x) is dict:
            x = [*x.keys(), *x.values()]
        if isinstance(x, list | tuple | set | frozenset | dict):
            n += len(x)
            kinds = set(map(type, x))  # C speed: a flat list of numbers is counted, not walked
            if kinds <= _SCALARS:
                if str in kinds or bytes in kinds:
                    n += sum(len(e) for e in x if type(e) in (str, bytes)) // 64
            else:
                todo.extend(x)
        elif isinstance(x, str | bytes):
            n += len(x) // 64
    return n


_SCALARS = frozenset({int, float, bool, str, bytes, type(None), complex})


def const(node: ast.AST, env: dict, modules: set[str] = frozenset()):
    """Value of a constant expression, or NotConvertible. Bounded (see MAX_CONST_LEN): no huge powers,
    repetitions, ranges consumed or factorials. `env` may hold "__shadowed__": names the program
    defines, never evaluated here as builtins."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, type(...)):
        return _bounded(node.value)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        items = [const(e, env, modules) for e in node.elts if not isinstance(e, ast.Starred) or _no()]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {const(k, env, modules): const(v, env, modules) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
        return _UN[type(node.op)](const(node.operand, env, modules))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        a, b = const(node.left, env, modules), const(node.right, env, modules)
        if isinstance(node.op, ast.Pow | ast.LShift) and isinstance(b, int) and abs(b) > 4096:
            _no()
        big = isinstance(a, int) and isinstance(b, int) and a.bit_length() * abs(b) > MAX_CONST_BITS
        if isinstance(node.op, ast.Pow) and big:
            _no()
        if isinstance(node.op, ast.Mult):
            for x, y in ((a, b), (b, a)):
                if isinstance(x, int) and isinstance(y, _SIZED) and x * len(y) > MAX_CONST_LEN:
                    _no()
        try:
            return _bounded(_BIN[type(node.op)](a, b))
        except Exception as e:  # noqa: BLE001 - e.g. 1/0 in a test: leave it to the fallback
            raise NotConvertible(str(e)) from None
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        if node.id in TYPES:
            return TYPES[node.id]
        _no()
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
        if node.value.id == "math" and node.attr in MATH:
            return MATH[node.attr]
        _no()
    if isinstance(node, ast.Subscript):
        try:
            return _bounded(const(node.value, env, modules)[const(node.slice, env, modules)])
        except NotConvertible:
            raise
        except Exception as e:  # noqa: BLE001
            raise NotConvertible(str(e)) from None
    if isinstance(node, ast.Slice):
        parts = [None if p is None else const(p, env, modules) for p in (node.lower, node.upper, node.step)]
        return slice(*parts)
    if isinstance(node, ast.Call):
        fn = const_func(node.func, env, modules)
        args = [const(a, env, modules) for a in node.args if not isinstance(a, ast.Starred) or _no()]
        kw = {k.arg: const(k.value, env, modules) for k in node.keywords if k.arg or _no()}
        name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
        if name in _CONSUMERS or name in ("factorial", "comb", "pow"):
            # Consuming a huge range, a factorial or power of a big number: the caller's time.
            for x in [*args, *kw.values()]:
                if isinstance(x, range) and len(x) > MAX_CONST_LEN:
                    _no()
                if name != "pow" and isinstance(x, int) and abs(x) > 20_000 and name in ("factorial", "comb"):
                    _no()
                if name == "pow" and len(args) == 2 and isinstance(args[1], int) and abs(args[1]) > 4096:
                    _no()
        try:
            return _bounded(fn(*args, **kw))
        except Exception as e:  # noqa: BLE001
            raise NotConvertible(str(e)) from None
    _no()


def const_func(node, env, modules):
    if (
        isinstance(node, ast.Name)
        and node.id in CONST_FUNCS
        and node.id not in env
        and node.id not in env.get("__shadowed__", ())
    ):
        return CONST_FUNCS[node.id]
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in modules
        and node.value.id == "math"
        and callable(MATH.get(node.attr))
    ):
        return MATH[node.attr]
    _no()


def _no():
    raise NotConvertible("not a constant")


class _Ctx:
    def __init__(self, env, modules, refs, rename, only, defined=frozenset(), tests_own=frozenset(),
                 reused=frozenset()):  # fmt: skip
        self.env, self.modules, self.refs, self.rename, self.only = env, modules, refs, rename, only
        self.defined, self.tests_own, self.reused = defined, tests_own, reused

    def is_candidate(self, name: str) -> bool:
        if name in self.rename:
            return True
        if name in self.tests_own:
            return False  # a name the tests define (a helper, a constant) is never the program's
        if self.only is not None:
            return name in self.only
        return (
            name not in CONST_FUNCS
            and name not in self.env
            and name not in _BUILTIN_NAMES
            and name not in self.refs
        )

    def arg(self, node):
        if isinstance(node, ast.Name) and node.id in self.refs:
            return {"t": "ref", "v": node.id}
        for sub in ast.walk(node) if any(_mutable(v) for v in self.env.values()) else ():
            # A mutable constant the tests name again (`a = [3, 1]; assert f(a) == a`) must be the object the
            # program mutated, as in plain Python: only the judge can give it that (see `_result.Shared`).
            if isinstance(sub, ast.Name) and _mutable(self.env.get(sub.id)) and sub.id in self.reused:
                _no()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and self.is_candidate(node.func.id):
            if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
                _no()
            # An argument built by the program's own class (MBPP's Pair(5, 24)): built in the sandbox.
            return {
                "t": "new",
                "v": [self.rename.get(node.func.id, node.func.id), [self.arg(a) for a in node.args]],
            }
        try:
            value = const(node, self.env, self.modules)
            if _aliased(value):
                # `[[0] * 3] * 3`: the rows are one list in Python; sent as a value they would be three.
                # The judge passes arguments with their aliasing (`_result.Shared`).
                _no()
            return to_wire(value)
        except NotConvertible:
            if isinstance(node, ast.List):
                return [self.arg(e) for e in node.elts]
            if isinstance(node, ast.Tuple):
                return {"t": "tuple", "v": [self.arg(e) for e in node.elts]}
            raise

    def chain(self, node):
        """(call, wrappers) for W(W(f(args))), or None."""
        wrappers = []
        while isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if self.is_candidate(name):
                if any(isinstance(a, ast.Starred) for a in node.args) or any(
                    k.arg is None for k in node.keywords
                ):
                    return None
                try:
                    call = (self.rename.get(name, name), [self.arg(a) for a in node.args],
                            {"t": "dict", "v": [[k.arg, self.arg(k.value)] for k in node.keywords]})  # fmt: skip
                except (NotConvertible, TypeError, ValueError):
                    return None
                return call, wrappers[::-1]
            if name in WRAPPERS and name not in self.env and node.args:
                # Wrappers run here with the real builtin, even if the program defines one of that name...
                inner = _Ctx(self.env, self.modules, self.refs, self.rename, self.only, self.defined,
                             self.tests_own, self.reused).chain(node.args[0])  # fmt: skip
                if inner is not None:
                    try:
                        extra = [const(a, self.env, self.modules) for a in node.args[1:]]
                        kw = {
                            k.arg: const(k.value, self.env, self.modules)
                            for k in node.keywords
                            if k.arg or _no()
                        }
                    except NotConvertible:
                        return None
                    return inner[0], inner[1] + [[name, extra, kw]] + wrappers[::-1]
            if name in self.defined and self.only is None and name not in self.tests_own:
                # ...but a call of the program's own `sum(10, 15)` is a call of the program.
                try:
                    call = (name, [self.arg(a) for a in node.args],
                            {"t": "dict", "v": [[k.arg, self.arg(k.value)] for k in node.keywords if k.arg or _no()]})  # fmt: skip
                except (NotConvertible, TypeError, ValueError):
                    return None
                return call, wrappers[::-1]
            return None
        return None

    def value(self, node):
        try:
            return True, const(node, self.env, self.modules)
        except NotConvertible:
            return False, None


def _check_for(test: ast.AST, ctx: _Ctx):
    """(call, check) for one assert's test expression; check is None for a constant true assert."""
    ok, v = ctx.value(test)
    if ok:
        return None, (None if v else {"kind": "const_false"})
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        c = ctx.chain(test.operand)
        if c:
            return c[0], {"kind": "falsy", "wrappers": c[1]}
    c = ctx.chain(test)
    if c:
        return c[0], {"kind": "truthy", "wrappers": c[1]}
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op = type(test.ops[0]).__name__
        left, right = test.left, test.comparators[0]
        # abs(CALL - C) < TOL
        if op in ("Lt", "LtE") and isinstance(left, ast.Call) and isinstance(left.func, ast.Name):  # noqa: SIM102
            if left.func.id == "abs" and "abs" not in ctx.env and len(left.args) == 1 and not left.keywords:
                inner = left.args[0]
                ok_t, tol = ctx.value(right)
                if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Sub) and ok_t:
                    for a, b in ((inner.left, inner.right), (inner.right, inner.left)):
                        c, (ok_e, exp) = ctx.chain(a), ctx.value(b)
                        if c and ok_e:
                            return c[0], {
                                "kind": "absdiff",
                                "wrappers": c[1],
                                "expected": exp,
                                "tol": tol,
                                "op": op,
                            }
        for a, b, o in ((left, right, op), (right, left, _FLIP.get(op))):
            if o is None or o not in OPS:
                continue
            c, (ok_e, exp) = ctx.chain(a), ctx.value(b)
            if c and ok_e:
                if o == "Is" and exp not in (True, False, None):
                    return None
                if (o, a) != (op, left) and o in ("In", "NotIn"):
                    continue
                return c[0], {"kind": "cmp", "op": o, "wrappers": c[1], "expected": exp}
        return None
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and test.func.attr == "isclose":  # noqa: SIM102
        if (
            isinstance(test.func.value, ast.Name)
            and test.func.value.id in ctx.modules
            and len(test.args) == 2
        ):
            try:
                kw = {k.arg: const(k.value, ctx.env, ctx.modules) for k in test.keywords if k.arg or _no()}
            except NotConvertible:
                return None
            if set(kw) <= {"rel_tol", "abs_tol"}:
                for a, b in ((test.args[0], test.args[1]), (test.args[1], test.args[0])):
                    c, (ok_e, exp) = ctx.chain(a), ctx.value(b)
                    if c and ok_e:
                        return c[0], {"kind": "isclose", "wrappers": c[1], "expected": exp, **kw}
    return None


def convert(
    tests: str, entry_point: str | None = None, code: str | None = None, tree: ast.Module | None = None
):
    """{"setup", "calls", "checks"} for tests in a convertible shape, else None. `entry_point`: only this
    function (and `candidate` under check) is the program's; other names called are not trusted to it.
    `tree`: `tests` already parsed (it is not changed)."""
    if tree is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(tests)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
    env: dict = {"__shadowed__": _defined(code)}
    modules: set[str] = {"math"}  # tests ran in the program's globals, where `math` was usually imported
    body = list(tree.body)
    setup: list[ast.stmt] = []
    # A leading setup block: statements before the first assert that are not all constants.
    first = next((i for i, s in enumerate(body) if isinstance(s, ast.Assert | ast.FunctionDef)), len(body))
    head = body[:first]
    try:
        for s in head:
            if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
                const(s.value, env, modules)
            elif not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) and not isinstance(
                s, ast.Import
            ):
                raise NotConvertible("setup")
    except NotConvertible:
        # Only plain statements may become setup (they run in the candidate process): no control flow,
        # no asserts, no definitions, so no test logic and no expected values move there.
        if not all(isinstance(s, ast.Assign | ast.AugAssign | ast.Expr) for s in head) or any(
            isinstance(n, ast.Assert | ast.Lambda) for s in head for n in ast.walk(s)
        ):
            return None
        setup, body = head, body[first:]
        if not any(isinstance(s, ast.Assert) for s in body):
            return None
    refs = {
        t.id
        for s in setup
        for n in ast.walk(s)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    only = None if entry_point is None else {entry_point}
    walk = _Walk(body, modules, only)
    # Every name bound in the tests' module scope (helpers, constants, the check function, setup names).
    tests_own = frozenset(module_names(tree, loads=False)[1])  # (`x := ...` never converts anyway)
    reused = _Reused(tree)
    try:
        walk.run(body, _Ctx(env, modules, refs, {}, only, env["__shadowed__"], tests_own, reused))
    except (NotConvertible, RecursionError, TypeError, ValueError):
        return None
    if walk.checks_defs and not walk.calls and not walk.checks:
        return None  # a check function that was never called: leave it to the fallback
    return {"setup": ast.unparse(setup) if setup else "", "calls": walk.calls, "checks": walk.checks}


class _Walk:
    """The statement walk of `convert`, which raises NotConvertible for a statement of no known shape.
    It collects `calls` (sent to the candidate, each with its wrappers), `checks` (kept in the caller)
    and `checks_defs` (`def check(candidate)` functions, taken only from the tests' module scope
    `body`), and adds the modules the tests import to `modules` (shared with every `_Ctx`). `only`: as
    `convert`'s `entry_point`, as a set (or None)."""

    def __init__(self, body: list[ast.stmt], modules: set[str], only: set[str] | None):
        self.body, self.modules, self.only = body, modules, only
        self.checks_defs: dict[str, ast.FunctionDef] = {}
        self.calls: list = []
        self.checks: list = []
        self.budget = MAX_JOB_ITEMS  # items left for the calls' arguments and the expected values

    # One frame per level of `check` nesting, called straight from `convert`: the frames under `const`
    # and `_check_for`, which meet the recursion limit on deeply nested tests, are as few as they can be.
    def run(self, stmts, ctx: _Ctx) -> None:
        for s in stmts:
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) or isinstance(s, ast.Pass):
                continue
            if isinstance(s, ast.Import) and all(a.asname is None and "." not in a.name for a in s.names):
                self.modules.update(a.name for a in s.names)
                continue
            if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
                ctx.env[s.targets[0].id] = const(s.value, ctx.env, ctx.modules)
                continue
            if (
                isinstance(s, ast.FunctionDef)
                and stmts is self.body
                and len(s.args.args) == 1
                and not s.decorator_list
            ):
                self.checks_defs[s.name] = s
                continue
            if (
                isinstance(s, ast.Expr)
                and isinstance(s.value, ast.Call)
                and isinstance(s.value.func, ast.Name)
            ):
                f = self.checks_defs.get(s.value.func.id)
                if f is not None and len(s.value.args) == 1 and isinstance(s.value.args[0], ast.Name):
                    # A check called from a check: its argument is the caller's parameter, i.e. the name
                    # that parameter stands for (never a program function of the parameter's name).
                    target = ctx.rename.get(s.value.args[0].id, s.value.args[0].id)
                    param = f.args.args[0].arg
                    # A parameter that shadows a name the tests' shapes give a meaning to (a module, a
                    # builtin, a constant of the tests) is left to the judge, which runs it as Python does.
                    if param in ctx.modules or param in ctx.env or param in _BUILTIN_NAMES or param in TYPES:
                        raise NotConvertible(f"check parameter {param!r} shadows a name")
                    only = None if self.only is None else self.only | {target}
                    inner = _Ctx(dict(ctx.env), ctx.modules, ctx.refs, {f.args.args[0].arg: target}, only,
                                 ctx.defined, ctx.tests_own, ctx.reused)  # fmt: skip
                    self.run(f.body, inner)
                    continue
            if isinstance(s, ast.Assert):
                got = _check_for(s.test, ctx)
                if got is None:
                    raise NotConvertible(ast.unparse(s)[:80])
                call, check = got
                if check is None:
                    continue
                self.budget -= items([call, check.get("expected")], self.budget)
                if self.budget < 0:
                    raise NotConvertible("the tests' values are over MAX_JOB_ITEMS")
                if call is not None:
                    # Wrappers go with the call: the candidate applies them to its real return value.
                    wrappers = [[n, to_wire(list(x)), to_wire(kw)] for n, x, kw in check.pop("wrappers")]
                    check["call"] = len(self.calls)
                    self.calls.append((*call, wrappers))
                self.checks.append(check)
                continue
            raise NotConvertible(type(s).__name__)


class _Reused:
    """`name in reused`: is `name` loaded more than once in the tests? Counted on first use only (a walk
    over every node; most tests never ask)."""

    def __init__(self, tree: ast.AST):
        self.tree, self.loads = tree, None

    def __contains__(self, name: str) -> bool:
        if self.loads is None:
            self.loads = module_names(self.tree)[0]
        return self.loads[name] > 1


def _aliased(v) -> bool:
    """Does value `v` hold one mutable container (list, dict, set, bytearray) at two places? Bounded by
    MAX_JOB_ITEMS containers visited."""
    seen: set[int] = set()
    todo, n = [v], 0
    while todo and n < MAX_JOB_ITEMS:
        x = todo.pop()
        n += 1
        t = type(x)
        if t in (list, dict, set, bytearray):
            if id(x) in seen:
                return True
            seen.add(id(x))
        if t is dict:
            todo.extend(x.values())
        elif t in (list, tuple, set, frozenset) and not set(map(type, x)) <= _SCALARS:
            todo.extend(x)
    return False


def _mutable(v, depth: int = 0) -> bool:
    """Does constant `v` hold a list, dict, set or bytearray (something a call could change in place)?"""
    if isinstance(v, list | dict | set | bytearray):
        return True
    if isinstance(v, tuple | frozenset) and depth < 50:
        return any(_mutable(x, depth + 1) for x in v)
    return False


def count_asserts(tests: str) -> int:
    try:
        return sum(isinstance(n, ast.Assert) for n in ast.walk(ast.parse(tests)))
    except (SyntaxError, ValueError, RecursionError):
        return 0


def _defined(code: str | None) -> frozenset:
    """Builtin names the program defines at top level (parsed, never run, here)."""
    if not code:
        return frozenset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. invalid escape sequences in the program's strings
            tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return frozenset()
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    return frozenset(names & _BUILTIN_NAMES)
