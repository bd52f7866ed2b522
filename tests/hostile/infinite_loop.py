# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: timeout
# tests: assert solve() == 42
while True:
    pass
