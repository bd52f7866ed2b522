# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: import os; assert os.path.exists("{OUTSIDE}/pwned.txt")
with open("{OUTSIDE}/pwned.txt", "w") as f:
    f.write("pwned")
