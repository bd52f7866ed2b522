# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 42
def solve():
    raise SystemExit(0)
