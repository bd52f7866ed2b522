# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 1
# Open a directory fd on a readable root, then write relative to it (the hook sees only the relative name).
import os, sys

d = os.open(os.path.dirname(os.__file__), os.O_RDONLY | os.O_DIRECTORY)
fd = os.open("pwned_dirfd.py", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d)
os.write(fd, b"pwned")


def solve():
    return 1
