# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: import os; assert not os.path.exists("{VICTIM}")
import os

os.remove("{VICTIM}")
