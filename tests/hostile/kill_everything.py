# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed crashed
# tests: assert solve() == 42
import os
import signal

os.kill(-1, signal.SIGKILL)
