# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert abs(solve() - 42) < 1e-9 and len([1]) == 1 and isinstance(solve(), int)
import builtins

builtins.abs = lambda x: 0
builtins.isinstance = lambda *a: True


def solve():
    return 0
