# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 42
import os

for fd in range(3, 300):
    try:
        os.write(fd, b"\nOK" + os.urandom(32) + b"\n")
    except OSError:
        pass
os._exit(0)
