# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: timeout
# tests: assert solve() == 42
import time

time.sleep(10**6)
