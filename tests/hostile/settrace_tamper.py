# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 42
import sys


def tracer(frame, event, arg):
    return tracer


sys.settrace(tracer)


def solve():
    return 0
