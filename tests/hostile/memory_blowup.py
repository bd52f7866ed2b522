# expect: memory
# tests: assert solve() == 42
chunks = []
while True:
    chunks.append("x" * (64 << 20))
