# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 1
# chdir into a read-only root, or use ../ relative paths, to write outside the working dir.
import os

try:
    os.chdir(os.path.dirname(os.__file__))
    open("pwned_chdir.py", "w").write("x")
except OSError:
    pass
open("a/../../pwned_dotdot", "w").write("x")


def solve():
    return 1
