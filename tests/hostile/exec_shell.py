# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed crashed
# tests: assert solve() == 42
import os

os.execv("/bin/sh", ["sh", "-c", "echo pwned > {OUTSIDE}/pwned4.txt"])
