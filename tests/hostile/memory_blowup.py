# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: memory
# tests: assert solve() == 42
chunks = []
while True:
    chunks.append("x" * (64 << 20))
