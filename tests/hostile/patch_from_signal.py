# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: import math\nassert math.isclose(solve(), 42.0)
import math
import signal


def handler(*_):
    math.isclose = lambda *a, **k: True


signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.0001, 0.0001)


def solve():
    return 0.0
