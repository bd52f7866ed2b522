# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: def check(candidate):\n    assert candidate(2) == 4\ncheck(square)
import builtins


def square(x):
    return 0


def check(candidate):
    return True


builtins.check = check
