# expect: failed crashed
# tests: assert solve() == 42
import os

while True:
    os.fork()
