# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# tests: assert solve() == 42
# Fills the working directory; the tmpfs size and RLIMIT_FSIZE stop it.
i = 0
while True:
    with open(f"fill{i}.bin", "wb") as f:
        f.write(b"z" * (8 << 20))
    i += 1
