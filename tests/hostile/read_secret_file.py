# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert SECRET == "{SECRET}"
with open("{SECRET_FILE}") as f:
    SECRET = f.read().strip()
