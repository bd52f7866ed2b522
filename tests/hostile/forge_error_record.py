# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 1
# Write a fake "compile error" record to every fd: must not become syntax_error (nor passed).
import json, os

rec = b"\nE" + json.dumps({"stage": "compile", "type": "SyntaxError", "msg": "x", "line": 1}).encode() + b"\n"
for fd in range(3, 64):
    try:
        os.write(fd, b"\nS\n" + rec + b'R["ok",1]\n' + b"PASS\n")
    except OSError:
        pass


def solve():
    return 0
