"""Run untrusted, model-written Python against tests; the verdict is decided where the program cannot reach.

The candidate runs in a fresh process cloned by a zygote that never held any job (so nothing of another
job is in its memory; own session and process group, CPU-time, address-space, process-count and
file-size limits, a private tmpfs working directory, scrubbed environment, no network, wall-clock
deadline). Native code is assumed: the kernel layers below are the boundary, the audit hook only
refuses early and readably. It is given only the program and the arguments of the calls to make (or a stdin);
it sends back each return value in a strict encoding (exact builtin types, no subclasses). The caller of
the pool keeps the expected values and compares: an object whose `==` always says yes, a patched harness
or builtins, a frame walk into the harness: none of them can reach the comparison.

- Function-call tests: asserts are converted to (call, expected) pairs by an AST pass (`_convert`);
  builtins wrapped around a call (`sum(f(x))`, `set(...)`) are applied in the candidate's process, under
  its limits. Tests of other shapes (loops, helpers, random inputs) run in a separate judge process forked
  after the candidate, which calls the candidate's functions over a pipe; only the judge can write its
  verdict. A name the tests define (helper, constant) is always the tests', never the program's. In the
  judge, arguments and return values share identities through a mirror kept on both sides (`_child._call`:
  every container that crossed and both sides still hold, synchronised both ways at every call): an
  argument the program mutates, now or in a later call, is mutated in the tests' own object, `f(a) is a`
  and `f() is f()` hold exactly when they would in plain Python, an iterator consumed after its inputs
  changed is refused (`error`), and an exception of a builtin type reaches the tests as that type. The
  program's other objects (its classes' instances, functions it returns) reach the tests as stand-ins
  they can pass back, call and read attributes of; using their own `==`, `str`, `len`... there is refused.
- The caller (the trainer's process) does bounded work per job: untrusted records are size- and
  bracket-counted before they are parsed, dicts/sets whose keys share hashes are refused before they
  are built, and any failure while judging one job becomes that job's `error` verdict.
- stdin/stdout tests: the whole stdout is compared by the caller, up to STDOUT_LIMIT (4 MiB); a program
  that prints more gets `output_limit`, never `passed`.
- Layers (docs/sandbox.md has which hold in which deployment, and how to run each): the candidate is
  PID 1 of its own PID, mount, IPC and UTS namespaces (its death kills everything it started; it cannot name
  any other process) and chroots into a read-only view holding only the Python install, three devices
  and its working dir (a noexec, size-capped tmpfs), so nothing else can be opened, stat'ed or listed; a
  network namespace; a seccomp filter (no memfd/SysV/POSIX shared memory, no exec, no fork, no changing
  any scheduling, no new namespaces, no ptrace, no sync, xattrs, file locks or page-cache probes); a
  uid of its worker's own when run as root (checked at start), every capability dropped;
  Landlock where the kernel has it (no execve, no TCP, scoped signals); no_new_privs; rlimits; an audit
  hook (`_guard`) refusing processes, sockets, ctypes and private modules, extension modules from outside
  the Python install, frame/gc introspection, directory fds and chdir outside the working dir, and writes
  outside it. Where the kernel refuses the namespaces or seccomp, the pool refuses to run programs
  (RuntimeError at start) unless MARLFLOW_SANDBOX_ALLOW_WEAK=1; without Landlock it warns.

- The caller's situation: a pool belongs to the process that made it (in a forked child `verify_many`
  starts a new one, a SandboxPool raises), workers outlive the thread that started them, the worker
  sets its own umask and fd limit, and `close()` wakes every waiting job (SandboxUnavailable).
- Input contract: a job is one kind of test (Python tests, a stdio or calls marker as the whole first
  line, or stdin/expect); anything else, unknown job keys and call arguments that are not a list are a
  ValueError. The verdict cache's key holds every job field and the MARLFLOW_SANDBOX_* switches.

Statuses: passed, failed, timeout, memory, crashed, syntax_error, output_limit, error (the job could not
be judged: tests that do not compile or nest too deeply, an answer over the decoding budget, a failure
of the caller's own code; `detail` says which). Limits are validated (timeout finite, 0 < t <= 600 s;
memory 1..262144 MiB; anything else, 10**400 and inf included, is a ValueError) and cannot be switched
off. Empty tests (blank, comments or docstrings only; stdio/call tests with no case) are a ValueError.

Python API (the trainer calls `verify_many` every step; identical jobs are cached when their verdict is
reproducible: no randomness or clock in program or tests, status passed/failed/syntax_error):

    from marlflow.sandbox import verify_many
    results = verify_many([(code, tests), (code2, "", stdin, expected)], timeout=5, memory_mb=1024)

Command line (prints one JSON line in every case; exit 0 whatever the verdict, 2 with a JSON error for
bad input, 1 if the command itself fails):

    marlflow sandbox --code sol.py [--tests tests.py] [--stdin in.txt --expect out.txt]
        [--entry-point NAME] [--timeout 5] [--memory-mb 1024]

Module order matters: `_result` (constants, encoding) and `_kernel` have no side effects beyond probing
Landlock; `_guard` snapshots modules and builtins at import, before `_child`, `_supervisor` (the worker
process), `_convert`/`_verdict` (the trusted side), `_pool` and `_cli` are imported.
"""

from marlflow.sandbox._result import (  # isort: skip
    CALLS_MARKER,
    MAX_MEMORY_MB,
    MAX_TIMEOUT,
    OUTPUT_CAP,
    RESULT_LIMIT,
    STATUSES,
    STDIO_MARKER,
    STDOUT_LIMIT,
    TMP_PREFIX,
    SandboxResult,
    check_limits,
    outputs_match,
    stdio_tests,
)
from marlflow.sandbox._kernel import _LL_ABI  # isort: skip
from marlflow.sandbox._guard import SandboxViolation  # isort: skip
from marlflow.sandbox._supervisor import _serve  # isort: skip
from marlflow.sandbox._convert import convert, count_asserts  # isort: skip
from marlflow.sandbox._pool import (  # isort: skip
    SandboxPool,
    SandboxUnavailable,
    clear_cache,
    programs_run,
    run_local,
    shutdown,
    verify,
    verify_many,
)
from marlflow.sandbox._cli import main  # isort: skip

__all__ = [
    "CALLS_MARKER", "MAX_MEMORY_MB", "MAX_TIMEOUT", "OUTPUT_CAP", "RESULT_LIMIT", "STATUSES", "STDIO_MARKER",
    "STDOUT_LIMIT", "TMP_PREFIX", "SandboxPool", "SandboxResult", "SandboxUnavailable", "SandboxViolation",
    "_LL_ABI", "_serve", "check_limits", "clear_cache", "convert", "count_asserts", "main", "outputs_match", "programs_run", "run_local",
    "shutdown", "stdio_tests", "verify", "verify_many",
]  # fmt: skip
