# expect: timeout
# tests: assert solve() == 42
while True:
    pass
