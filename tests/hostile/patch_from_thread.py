# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: import math\nassert math.isclose(solve(), 42.0)
import math
import threading


def patch():
    while True:
        math.isclose = lambda *a, **k: True


threading.Thread(target=patch, daemon=True).start()


def solve():
    return 0.0
