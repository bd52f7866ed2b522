# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 42
try:
    raise ValueError
except ValueError as e:
    tb = e.__traceback__
    frame = tb.tb_frame.f_back
    SECRETS = dict(frame.f_locals)
