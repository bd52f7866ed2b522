# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve(1) == [1, 2, 3]\nassert solve2(5) == 120
# An object whose == is always true, and an int subclass that equals everything.


class Yes(list):
    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


class Int(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def solve(x):
    return Yes()


def solve2(x):
    return Int(0)
