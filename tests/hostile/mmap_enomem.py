# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: memory
# tests: assert solve() == 1
# A huge anonymous mmap fails with ENOMEM under the address-space limit: that is `memory`.
import mmap

m = mmap.mmap(-1, 1 << 40)


def solve():
    return 1
