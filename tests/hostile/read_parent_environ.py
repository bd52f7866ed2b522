# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert "{SECRET}" in DATA
DATA = open("/proc/{PYTEST_PID}/environ", "rb").read().decode(errors="replace")
