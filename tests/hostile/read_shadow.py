# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert len(DATA) > 0
DATA = open("/etc/shadow").read()
