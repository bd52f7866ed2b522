# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: import math\nassert math.isclose(solve(), 42.0)
import math
import sys

math.isclose = lambda *a, **k: True
sys.modules["math"] = type(sys)("math")
sys.modules["math"].isclose = lambda *a, **k: True


def solve():
    return 0.0
