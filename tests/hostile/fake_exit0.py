# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 42
import sys


def solve():
    return 0


sys.exit(0)
