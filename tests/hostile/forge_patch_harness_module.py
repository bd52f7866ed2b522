# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 42
# Monkeypatch every loaded marlflow module and the json/operator modules the harness uses.
import sys, json, operator

for name, mod in list(sys.modules.items()):
    if name.startswith("marlflow"):
        for attr in list(vars(mod)):
            obj = getattr(mod, attr)
            if callable(obj) and not isinstance(obj, type):
                try:
                    setattr(mod, attr, lambda *a, **k: True)
                except Exception:
                    pass
operator.eq = lambda a, b: True
json.dumps = lambda *a, **k: '["ok",42]'


def solve():
    return 0
