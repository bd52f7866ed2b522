# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert sorted(solve()) == [1, 2, 3]
# Rebind builtins the comparison might use, in the builtins module and in this namespace.
import builtins

builtins.sorted = lambda *a, **k: [1, 2, 3]
builtins.len = lambda *a: 3
builtins.isinstance = lambda *a: True
builtins.type = lambda *a: list
sorted = builtins.sorted


def solve():
    return [9]
