# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: output_limit timeout
# tests: assert solve() == 42
import os

while True:
    os.write(2, b"e" * 65536)
