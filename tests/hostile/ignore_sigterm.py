# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: timeout
# tests: assert solve() == 42
import signal

for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):
    signal.signal(s, signal.SIG_IGN)
while True:
    pass
