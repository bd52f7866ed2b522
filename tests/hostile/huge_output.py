# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: output_limit timeout
# tests: assert solve() == 42
import sys

while True:
    sys.stdout.write("y" * 65536)
