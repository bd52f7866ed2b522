# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed crashed
# tests: assert solve() == 42
import subprocess
import sys

while True:
    subprocess.Popen([sys.executable, "-c", "while True: pass"])
