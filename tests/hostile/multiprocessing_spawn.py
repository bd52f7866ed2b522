# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed crashed
# tests: assert solve() == 42
import multiprocessing as mp

for _ in range(100):
    mp.Process(target=lambda: None).start()
