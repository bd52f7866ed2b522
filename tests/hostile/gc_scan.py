# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 42
import gc
import os

for obj in gc.get_objects():
    for v in getattr(obj, "values", lambda: [])() if isinstance(obj, dict) else []:
        if isinstance(v, bytes) and len(v) == 32:
            for fd in range(3, 300):
                try:
                    os.write(fd, b"\nOK" + v + b"\n")
                except OSError:
                    pass
os._exit(0)
