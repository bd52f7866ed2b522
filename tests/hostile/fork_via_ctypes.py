# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed crashed
# tests: assert solve() == 42
import ctypes

libc = ctypes.CDLL(None)
while True:
    libc.fork()
