# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: import os; assert os.path.exists("{OUTSIDE}/pwned2.txt")
import os

fd = os.open("{OUTSIDE}/pwned2.txt", os.O_WRONLY | os.O_CREAT, 0o644)
os.write(fd, b"pwned")
