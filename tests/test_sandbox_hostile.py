"""The hostile corpus (tests/hostile/*.py) is contained: each program gets a non-passing status from its
`# expect:` line, no process or file outlives it, and nothing outside the sandbox changes.

Each corpus file is a solution; its `# tests:` line (with `\\n` for newlines) is the test code, written
so that it passes only if the attack worked. Placeholders: {OUTSIDE} a world-writable folder outside
the sandbox, {VICTIM} a world-writable file in it, {SECRET_FILE} a world-readable secret, {SECRET},
{PYTEST_PID}; {HIDDEN} (tests only) a random number the program's text does not contain.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from marlflow import sandbox

HOSTILE = sorted((Path(__file__).parent / "hostile").glob("*.py"))
SECRET = "s3cr3t-" + os.urandom(6).hex()
HIDDEN = str(10**9 + int.from_bytes(os.urandom(3), "big"))  # in the tests only, never in the program


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _sandbox_dirs() -> set[str]:
    found = set()
    for d in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(d):
            found |= {os.path.join(d, n) for n in os.listdir(d) if n.startswith(sandbox.TMP_PREFIX)}
    return found


def _parse(path: Path, subst: dict) -> tuple[str, str, set[str]]:
    text = path.read_text()
    for k, v in subst.items():
        text = text.replace("{" + k + "}", v)
    expect, tests, stdio = set(), [], {}
    for line in text.splitlines():
        if line.startswith("# expect:"):
            expect = set(line.split(":", 1)[1].split())
        elif line.startswith("# tests:"):
            tests.append(line.split(":", 1)[1].strip().replace("\\n", "\n").replace("{HIDDEN}", HIDDEN))
        elif line.startswith(("# stdio:", "# stdout:")):
            key, value = line[2:].split(":", 1)
            stdio[key] = value.strip().replace("\\n", "\n")
    assert expect and (tests or stdio), f"{path.name} needs '# expect:' and '# tests:' (or '# stdio:') lines"
    assert expect <= set(sandbox.STATUSES) - {"passed"}
    if stdio:  # a stdin/stdout case: the expected stdout stays with the caller
        return text, sandbox.stdio_tests([(stdio["stdio"], stdio["stdout"])]), expect
    return text, "\n".join(tests) + "\n", expect


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    outside = base / "outside"
    outside.mkdir()
    os.chmod(base, 0o777)
    os.chmod(outside, 0o777)  # world-writable: only the sandbox itself may stop the writes
    victim = outside / "victim.txt"
    victim.write_text("keep me")
    os.chmod(victim, 0o666)
    secret_file = base / "secret.txt"
    secret_file.write_text(SECRET)
    os.chmod(secret_file, 0o644)
    return {
        "OUTSIDE": str(outside),
        "VICTIM": str(victim),
        "SECRET_FILE": str(secret_file),
        "SECRET": SECRET,
        "PYTEST_PID": str(os.getpid()),
    }


@pytest.fixture(scope="module")
def results(world):
    os.environ["MARLFLOW_HOSTILE_SECRET"] = SECRET  # must not reach the sandboxed program
    cases = [_parse(p, world) for p in HOSTILE]
    dirs_before = _sandbox_dirs()
    outside_before = sorted(os.listdir(world["OUTSIDE"]))
    with sandbox.SandboxPool(2) as pool:
        pool.start()
        workers = {w.proc.pid for w in pool._all}
        fds_before = len(os.listdir("/proc/self/fd"))
        jobs = [{"code": c, "tests": t, "timeout": 3, "memory_mb": 256} for c, t, _ in cases]
        got = pool.map(jobs)
        after = pool.map(
            [{"code": "def f():\n    return 1\n", "tests": "assert f() == 1", "timeout": 5, "memory_mb": 512}]
        )
        live = {w.proc.pid for w in pool._all}
        strays = _descendants(os.getpid()) - live - workers
        # Workers may legitimately be replaced; anything else below this test process is a leak.
        strays = {
            p
            for p in strays
            if Path(f"/proc/{p}/cmdline").exists()
            and b"import _serve; _serve()" not in Path(f"/proc/{p}/cmdline").read_bytes()
        }
        fds_after = len(os.listdir("/proc/self/fd"))
    del os.environ["MARLFLOW_HOSTILE_SECRET"]
    return {
        "cases": dict(zip([p.name for p in HOSTILE], zip(got, [e for _, _, e in cases]))),
        "after": after[0],
        "strays": strays,
        "fds": (fds_before, fds_after),
        "dirs": (dirs_before, _sandbox_dirs()),
        "outside": (outside_before, sorted(os.listdir(world["OUTSIDE"]))),
    }


def test_corpus_is_big_enough():
    assert len(HOSTILE) >= 58


@pytest.mark.slow
@pytest.mark.parametrize("name", [p.name for p in HOSTILE])
def test_hostile_program_is_contained(results, name):
    r, expect = results["cases"][name]
    assert not r.passed, f"{name} passed: {r}"
    assert r.status in expect, f"{name}: status {r.status!r}, expected one of {sorted(expect)}; {r.detail}"
    assert len(r.stdout) <= sandbox.OUTPUT_CAP and len(r.stderr) <= sandbox.OUTPUT_CAP


def test_nothing_outlives_the_corpus(results, world):
    assert results["after"].passed, "the pool must keep working after the corpus"
    assert not results["strays"], f"stray processes: {results['strays']}"
    assert results["fds"][1] <= results["fds"][0], f"file descriptors leaked: {results['fds']}"
    before, after = results["dirs"]
    assert after <= before, f"sandbox working directories left behind: {after - before}"
    assert results["outside"][0] == results["outside"][1]
    assert Path(world["VICTIM"]).read_text() == "keep me"
    assert not [p for p in Path(world["OUTSIDE"]).iterdir() if p.name.startswith("pwned")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["infinite_loop.py", "write_outside.py", "fake_os_exit.py", "read_env_secret.py"]
)
def test_command_line_contains_hostile_programs(tmp_path, world, name):
    code, tests, expect = _parse(Path(__file__).parent / "hostile" / name, world)
    (tmp_path / "code.py").write_text(code)
    (tmp_path / "tests.py").write_text(tests)
    env = dict(os.environ, MARLFLOW_HOSTILE_SECRET=SECRET)
    cmd = [sys.executable, "-m", "marlflow.sandbox", "--code", str(tmp_path / "code.py"),
           "--tests", str(tmp_path / "tests.py"), "--timeout", "2", "--memory-mb", "512"]  # fmt: skip
    before = _descendants(os.getpid())
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    import json

    r = json.loads(out.stdout)
    assert r["passed"] is False and r["status"] in expect, r
    assert _descendants(os.getpid()) <= before
    assert not [p for p in Path(world["OUTSIDE"]).iterdir() if p.name.startswith("pwned")]
    assert stat.S_IMODE(os.stat(world["OUTSIDE"]).st_mode) == 0o777


KERNEL_ONLY = ["write_outside.py", "read_secret_file.py", "socket_connect.py", "kill_parent.py", "exec_shell.py",
               "delete_outside.py", "read_parent_environ.py"]  # fmt: skip


def test_kernel_layers_hold_without_the_audit_hook(world):
    """With the interpreter-level hook switched off, the kernel layers (the read-only view, PID and network
    namespaces, seccomp, the uid/caps drop; Landlock where the kernel has it) must still contain file,
    network, signal and exec attacks. Runs in every deployment the pool accepts (docs/sandbox.md)."""
    cases = [_parse(Path(__file__).parent / "hostile" / n, world) for n in KERNEL_ONLY]
    jobs = [{"code": c, "tests": t, "timeout": 3, "memory_mb": 256, "audit_hook": False} for c, t, _ in cases]
    with sandbox.SandboxPool(2) as pool:
        workers = {w.proc.pid for w in pool.start()._all}
        if pool._all[0].info.get("missing") and sandbox._LL_ABI < 6:
            pytest.skip("an opted-in weak deployment (MARLFLOW_SANDBOX_ALLOW_WEAK) without Landlock ABI >= 6")
        got = pool.map(jobs)
        assert workers <= {w.proc.pid for w in pool._all}, "a hostile program killed its worker"
    for name, r in zip(KERNEL_ONLY, got):
        assert not r.passed and r.status in ("failed", "crashed"), (name, r)
        assert "SandboxViolation" not in r.detail, (name, r.detail)
    assert Path(world["VICTIM"]).read_text() == "keep me"
    assert not [p for p in Path(world["OUTSIDE"]).iterdir() if p.name.startswith("pwned")]
