"""The interpreter layer: a snapshot of common modules and builtins, and the audit hook for the candidate.

Imported before the child and supervisor modules so the snapshot is taken when the worker starts, before
any job (or anything else in the worker) could have patched a module. The hook is not a boundary (native
code is assumed: a pure-Python program gets there through a crafted code object); it refuses, early and
with a readable SandboxViolation, processes, sockets, ctypes and private extension modules (also when
loaded under another name), frame and gc introspection, directory
file descriptors and `chdir` outside the working directory (so `dir_fd=` / relative-path tricks cannot
escape), `..` in relative paths, file writes outside the working directory, and extension modules (native
code) from anywhere but the read-only Python install. It is not the barrier against native code (native
code never calls it): the kernel layers are (docs/sandbox.md); it makes their refusals early and readable.
"""

from __future__ import annotations

import builtins
import os
import sys
import types

# Modules whose attributes the harness relies on; restored before the harness encodes results.
_GUARDED = [
    "builtins", "math", "cmath", "re", "collections", "itertools", "functools", "heapq", "string", "operator",
    "random", "bisect", "statistics", "decimal", "fractions", "json", "copy", "typing", "sys", "os", "hashlib",
    "array", "numbers", "abc", "enum",
]  # fmt: skip
for _m in _GUARDED:
    __import__(_m)
_MODULE_SNAPSHOT = {m: (sys.modules[m], dict(sys.modules[m].__dict__)) for m in _GUARDED}
_BUILTINS = dict(builtins.__dict__)
_FRAME_ATTRS = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"}
# Extension modules that reach below the interpreter; refused by name and by file, whatever they are
# imported as (`spec_from_file_location("x._posixsubprocess", ...)` loads the same init function).
_PRIVATE_MODULES = {"_posixsubprocess", "_ctypes", "_xxsubinterpreters", "_testcapi", "_testinternalcapi",
                    "_testmultiphase", "_xxinterpchannels", "_lsprof", "_tracemalloc", "faulthandler",
                    "_posixshmem"}  # fmt: skip
_BLOCKED_EVENTS = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
    "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__", "socket.connect",
    "socket.bind", "socket.getaddrinfo", "socket.sendto", "sys.settrace", "sys.setprofile",
    "sys._current_frames", "sys._current_exceptions", "sys.addaudithook", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents", "code.__new__",
    "resource.setrlimit", "resource.prlimit", "os.setuid", "os.setgid", "os.chroot", "os.symlink",
    "os.link", "sys.remote_exec", "_posixsubprocess.fork_exec",
}  # fmt: skip
_PATH_EVENTS = {
    "os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown", "os.utime",
    "os.truncate", "shutil.rmtree", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr",
}  # fmt: skip


class SandboxViolation(PermissionError):
    """Raised inside the sandbox for a refused operation (an OSError, so stdlib fallbacks work)."""


class _NoFrame(ValueError):
    # namedtuple, typing and enum call sys._getframe inside `except (AttributeError, ValueError)`.
    pass


def neuter_private_modules() -> None:
    """Replace the dangerous entry points of private modules the worker already imported (an import of a
    module already in sys.modules raises no audit event)."""

    def refused(*a, _violation=SandboxViolation, **k):  # bound now: the program may rebind the name later
        raise _violation("sandbox: process creation is not allowed")

    for name in _PRIVATE_MODULES:
        mod = sys.modules.pop(name, None)
        if mod is not None:
            for attr in list(vars(mod)):
                if not attr.startswith("__"):
                    setattr(mod, attr, refused)


def _path_checks(wd: str, ext_ok: tuple[str, ...]):
    """(native_allowed, inside): the audit hook's path tests, closures over `wd` (the working dir with a
    trailing "/"), `ext_ok` (the read roots, each with a trailing "/") and the os functions as they are
    now. Called once, by `make_audit_hook`, before the program runs; the hook holds the closures
    themselves, never looks them up by name, so the program cannot swap them for others."""
    abspath, fspath, getcwd = os.path.abspath, os.fspath, os.getcwd
    # Builtins as well: the program can rebind builtins.isinstance, any, str ... (no audit event for that).
    _isinstance, _any, _str, _bytes, _int, _Exception = isinstance, any, str, bytes, int, Exception

    def native_allowed(filename) -> bool:
        # Only plain string ops and no patchable module globals: the program may have replaced posixpath.
        try:
            p = fspath(filename)
        except _Exception:
            return False
        if _isinstance(p, _bytes):
            p = p.decode("utf-8", "surrogateescape")
        if not _isinstance(p, _str) or "\0" in p or not p.startswith("/"):
            return False
        if _any(part in ("", ".", "..") for part in p[1:].split("/")):
            return False
        return p.startswith(ext_ok) and not (p + "/").startswith(wd)

    def resolve(path) -> str | None:
        try:
            p = fspath(path)
            if _isinstance(p, _bytes):
                p = p.decode("utf-8", "surrogateescape")
            if "\0" in p:
                return None
            if not p.startswith("/"):
                # A relative path may be resolved against a dir_fd the hook cannot see; without `..`
                # it stays below that directory, and directory fds exist only inside the working dir.
                if ".." in p.split("/"):
                    return None
                p = getcwd() + "/" + p
            return abspath(p)
        except _Exception:
            return None

    def inside(path, allowed) -> bool:
        if _isinstance(path, _int):
            return True  # an fd the process already holds
        p = resolve(path)
        return p is not None and ((p + "/").startswith(allowed) or p in {a.rstrip("/") for a in allowed})

    return native_allowed, inside


def make_audit_hook(workdir: str, read_roots: list[str]):
    """Audit hook for the untrusted program. Its state lives only in this closure (and in the closures
    of `_path_checks` it holds)."""
    wd = workdir.rstrip("/") + "/"
    ok_read = tuple(r.rstrip("/") + "/" for r in read_roots) + (wd, "/dev/null", "/dev/urandom", "/dev/zero")
    ok_write = (wd, "/dev/null")
    isdir = os.path.isdir
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    path_flags = getattr(os, "O_PATH", 0) | getattr(os, "O_DIRECTORY", 0)
    # Copies held by the closure: the program can import this (already loaded) module without an audit event
    # and empty or rebind its sets, but not reach these.
    private, blocked = frozenset(_PRIVATE_MODULES), frozenset(_BLOCKED_EVENTS)
    frame_attrs, path_events, basename = frozenset(_FRAME_ATTRS), frozenset(_PATH_EVENTS), os.path.basename
    # The exception classes and builtins it uses too: a program may rebind the module's or builtins' names.
    violation, no_frame, import_error, attribute_error = (
        SandboxViolation,
        _NoFrame,
        ImportError,
        AttributeError,
    )
    _isinstance, _any, _all, _len, _str, _bool, _int = isinstance, any, all, len, str, bool, int
    path_types = (str, bytes, os.PathLike)
    native_allowed, inside = _path_checks(wd, tuple(r.rstrip("/") + "/" for r in read_roots))

    def hook(event: str, args) -> None:
        if event in blocked or event.startswith(("ctypes.", "os.exec", "os.spawn", "os.posix_spawn")):
            raise violation(f"sandbox: {event} is not allowed")
        if event == "sys._getframe":
            raise no_frame("sandbox: frame access is not allowed")
        if event == "object.__getattr__" and _len(args) > 1 and args[1] in frame_attrs:
            raise attribute_error("sandbox: frame access is not allowed")
        if event == "import" and args:
            name = _str(args[0]).rpartition(".")[2]
            base = basename(_str(args[1])).partition(".")[0] if _len(args) > 1 and args[1] else ""
            if name in private or base in private:
                raise import_error(f"sandbox: module {args[0]} is not allowed")
            # A filename comes with the event only where a file is about to be loaded as native code
            # (_imp.create_dynamic): an extension module written to the working dir, a /proc/self/fd path.
            if _len(args) > 1 and args[1] is not None and not native_allowed(args[1]):
                raise import_error(f"sandbox: extension module {args[1]!r} is outside the Python install")
        elif event == "open" and args:
            mode, flags = (args[1] if _len(args) > 1 else "r") or "", (args[2] if _len(args) > 2 else 0) or 0
            writing = _any(c in _str(mode) for c in "wax+") or _bool(flags & write_flags)
            if not inside(args[0], ok_write if writing else ok_read):
                raise violation(f"sandbox: cannot open {args[0]!r} ({'write' if writing else 'read'})")
            # A directory fd outside the working dir would anchor dir_fd= escapes the hook cannot see.
            dir_open = not _isinstance(args[0], _int) and (flags & path_flags or isdir(args[0]))
            if dir_open and not inside(args[0], (wd,)):
                raise violation(f"sandbox: cannot open directory {args[0]!r}")
        elif event == "os.chdir" and args:
            if _isinstance(args[0], _int) or not inside(args[0], (wd,)):
                raise violation(f"sandbox: cannot chdir to {args[0]!r}")
        elif event in ("os.listdir", "os.scandir") and args:
            if not inside(args[0] if args[0] is not None else ".", ok_read):
                raise violation(f"sandbox: cannot list {args[0]!r}")
        elif event in path_events:
            paths = [a for a in args[:2] if _isinstance(a, path_types)]
            if not paths or not _all(inside(p, ok_write) for p in paths):
                raise violation(f"sandbox: {event} outside the working directory is not allowed")

    return hook


_ENCODING = ("builtins", "json", "collections")  # what encoding an answer uses (`_child._call`)


def restore_modules(only: tuple[str, ...] | None = None) -> None:
    """Put the snapshot's modules and their attributes back; `only`: just these modules (per call: cheap)."""
    if only is not None:
        for name in only:
            mod, snap = _MODULE_SNAPSHOT[name]
            sys.modules[name] = mod
            d = mod.__dict__
            if len(d) != len(snap) or any(d.get(k, d) is not v for k, v in snap.items()):
                d.clear()
                d.update(snap)
        return
    for name, (mod, snap) in _MODULE_SNAPSHOT.items():
        sys.modules[name] = mod
        d = mod.__dict__
        if len(d) != len(snap) or any(d.get(k, d) is not v for k, v in snap.items()):
            d.clear()
            d.update(snap)
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, types.ModuleType):
            del sys.modules[name]
