# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: memory
# tests: assert solve() == 42
buf = bytearray(64 << 30)
