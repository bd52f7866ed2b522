# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert abs(solve() - 42) < 1e-9
def solve():
    globals()["__builtins__"]["abs"] = lambda x: 0
    import builtins

    builtins.abs = lambda x: 0
    return 0
