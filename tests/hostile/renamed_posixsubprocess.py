# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 1
# Load _posixsubprocess under another name and call fork_exec directly (no subprocess.Popen event).
import importlib.util, os, sys

path = os.path.join(os.path.dirname(os.__file__), "lib-dynload")
so = [f for f in os.listdir(path) if f.startswith("_posixsubprocess")][0]
spec = importlib.util.spec_from_file_location("innocent._posixsubprocess", os.path.join(path, so))
mod = importlib.util.module_from_spec(spec)
mod.fork_exec(
    [b"/bin/sh"],
    [b"/bin/sh"],
    True,
    (),
    None,
    None,
    -1,
    -1,
    -1,
    -1,
    -1,
    -1,
    -1,
    -1,
    False,
    False,
    None,
    None,
    None,
    -1,
    None,
    False,
)


def solve():
    return 1
