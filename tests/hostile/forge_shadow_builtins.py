# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert abs(solve(2.0) - 4.0) < 1e-6\nassert set(solve2()) == set([1, 2])\nassert round(solve(1.0), 2) == 1.0
# Module-level functions that shadow the builtins the tests call around the candidate's function.


def abs(x):
    return 0


def set(x):
    return {1, 2}


def round(*a):
    return 1.0


def solve(x):
    return -100.0


def solve2():
    return [7]
