# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 1
# Reach an already-imported _posixsubprocess through sys.modules or another module and call fork_exec.
import sys

mod = sys.modules.get("_posixsubprocess")
if mod is None:
    import subprocess

    mod = subprocess._posixsubprocess
mod.fork_exec(
    [b"/bin/true"],
    [b"/bin/true"],
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
