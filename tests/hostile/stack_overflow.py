# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed crashed memory timeout
# tests: assert solve() == 42
import sys

sys.setrecursionlimit(10**8)


def f(n):
    return f(n + 1) + 1


f(0)
