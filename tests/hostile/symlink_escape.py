# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert open("link").read() == "{SECRET}"
import os

os.symlink("{SECRET_FILE}", "link")
