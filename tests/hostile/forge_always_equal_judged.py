# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: for i in range(3):\n    assert solve(i) == i * 10
# The same forgery against the fallback judge (tests with a loop are not converted).


class Int(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def solve(x):
    return Int(-1)
