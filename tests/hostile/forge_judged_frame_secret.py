# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: for i in range(2):\n    assert solve(i) == {HIDDEN} + i
# Look for the test source (and so the hidden expected value) anywhere reachable from a frame.
import re
import signal

seen = []
pattern = re.compile(r"== (\d+) \+ i")


def scan(v):
    if isinstance(v, str | bytes):
        m = pattern.search(v if isinstance(v, str) else v.decode("latin-1"))
        if m:
            seen.append(int(m.group(1)))
    elif isinstance(v, dict):
        for x in list(v.values())[:1000]:
            scan(x) if isinstance(x, str | bytes) else None


def handler(sig, frame):
    f = frame
    while f is not None:
        try:
            for v in list(f.f_locals.values()) + list(f.f_globals.values()):
                scan(v)
        except Exception:
            pass
        f = f.f_back


signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.001)
import time

time.sleep(0.05)


def solve(i):
    return (seen[0] if seen else -1) + i
