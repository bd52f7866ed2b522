# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: import os; assert os.path.exists("{OUTSIDE}/pwned3.txt")
import os

os.chdir("{OUTSIDE}")
with open("pwned3.txt", "w") as f:
    f.write("pwned")
