# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert OK
import socket

a, b = socket.socketpair()
OK = True
