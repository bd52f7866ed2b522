# expect: failed
# tests: assert OK
import socket

a, b = socket.socketpair()
OK = True
