# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert SECRET == "{SECRET}"
import os

SECRET = os.environ.get("MARLFLOW_HOSTILE_SECRET", "") or os.environ.get("HF_TOKEN", "")
