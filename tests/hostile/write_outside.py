# expect: failed
# tests: import os; assert os.path.exists("{OUTSIDE}/pwned.txt")
with open("{OUTSIDE}/pwned.txt", "w") as f:
    f.write("pwned")
