# expect: memory
# tests: assert solve() == 42
buf = bytearray(64 << 30)
