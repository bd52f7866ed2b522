# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve(3) == 1234567
# A signal handler receives the current frame; walk f_back into the harness and read its locals
# (expected values, result fd) to answer with the expected value or forge a verdict.
import os, signal

found = {}


def handler(sig, frame):
    f = frame
    while f is not None:
        try:
            found.update({k: v for k, v in f.f_locals.items() if not k.startswith("__")})
        except Exception:
            pass
        f = f.f_back


signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.001)
import time

time.sleep(0.05)


def solve(x):
    for v in found.values():
        if isinstance(v, dict) and "expected" in v:
            return v["expected"]
    return 0
