# ruff: noqa  (deliberately hostile program for the sandbox corpus)
# expect: failed
# stdio: 5\n
# stdout: 10\n
# Print the expected answer, then 100 KB of garbage past the old 64 KiB judged cap.
import sys

n = int(input())
print(n * 2)
sys.stdout.write("x" * 100_000 + "\n")
