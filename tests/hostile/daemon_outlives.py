# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed crashed
# tests: assert solve() == 42
import os
import time

if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
