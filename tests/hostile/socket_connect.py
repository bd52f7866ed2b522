# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert CONNECTED
import socket

s = socket.create_connection(("1.1.1.1", 53), timeout=1)
CONNECTED = True
