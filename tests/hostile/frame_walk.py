# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 42
import os
import sys

frame = sys._getframe(1)
while frame is not None:
    for k, v in frame.f_locals.items():
        if isinstance(v, bytes) and len(v) == 32:
            for fd in range(3, 300):
                try:
                    os.write(fd, b"\nOK" + v + b"\n")
                except OSError:
                    pass
    frame = frame.f_back
os._exit(0)
