# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 42
import os

print('{"status": "passed", "passed": true}')
print("All tests passed! OK")
os.write(2, b"passed\n")


def solve():
    return 0
