"""Kernel isolation helpers (ctypes; Python 3.11 has no os.unshare): network namespace, capabilities,
Landlock, prctl. Every helper returns False when the kernel refuses; the other layers still hold."""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWUSER, _CLONE_NEWNET, _CLONE_NEWNS = 0x10000000, 0x40000000, 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 0x4000, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 1, 38, 36
_SYS_LANDLOCK = (444, 445, 446)  # create_ruleset, add_rule, restrict_self (same on all Linux arches)


def _prctl(option: int, arg: int) -> bool:
    return _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0


def _unshare_network() -> bool:
    """Move this (single-threaded) process into a new, empty network namespace."""
    if not sys.platform.startswith("linux"):
        return False
    if os.geteuid() == 0 and _libc.unshare(_CLONE_NEWNET) == 0:
        return True
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        return False
    # Map our own ids so files we create keep their owner (optional; failure is harmless).
    for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with contextlib.suppress(OSError), open(f"/proc/self/{path}", "w") as f:
            f.write(text)
    return True


def _drop_capabilities() -> bool:
    """Clear the effective, permitted and inheritable capability sets (capset(2), version 3)."""
    header = struct.pack("Ii", 0x20080522, 0)
    data = bytes(24)  # two empty {effective, permitted, inheritable} u32 triples
    return _libc.capset(header, data) == 0


def _landlock_abi() -> int:
    if not sys.platform.startswith("linux"):
        return 0
    v = _libc.syscall(_SYS_LANDLOCK[0], None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(v), 0)


_LL_ABI = _landlock_abi()


def _landlock(read_roots: list[str], rw_dir: str | None, rw_files: list[str]) -> bool:
    """Restrict this process: read-only `read_roots`, read-write `rw_dir` (if any), no execve, no TCP."""
    abi = _LL_ABI
    if abi < 1:
        return False
    fs_all = (1 << 13) - 1
    if abi >= 2:
        fs_all |= 1 << 13  # REFER
    if abi >= 3:
        fs_all |= 1 << 14  # TRUNCATE
    if abi >= 5:
        fs_all |= 1 << 15  # IOCTL_DEV
    read_dir = (1 << 2) | (1 << 3)
    file_rw = (1 << 1) | (1 << 2) | (fs_all & (1 << 14))
    fields = [fs_all]
    if abi >= 4:
        fields.append(0b11)  # handle TCP bind + connect, allow none
    if abi >= 6:
        fields.append(0b11)  # scope abstract unix sockets and signals to this domain
    attr = struct.pack(f"{len(fields)}Q", *fields)
    fd = _libc.syscall(_SYS_LANDLOCK[0], attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if fd < 0:
        return False
    try:
        rules = (
            [(p, read_dir) for p in read_roots]
            + ([(rw_dir, fs_all & ~1)] if rw_dir else [])
            + [(p, file_rw) for p in rw_files]
        )
        for path, access in rules:
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if not os.path.isdir(path):
                    access &= file_rw
                rule = struct.pack("=Qi", access, pfd)
                _libc.syscall(_SYS_LANDLOCK[1], fd, ctypes.c_int(1), rule, ctypes.c_uint32(0))
            finally:
                os.close(pfd)
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        return _libc.syscall(_SYS_LANDLOCK[2], fd, ctypes.c_uint32(0)) == 0
    finally:
        os.close(fd)


def _read_roots() -> list[str]:
    import sysconfig

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError):
            roots.add(sysconfig.get_paths()[key])
    roots |= {p for p in sys.path if p and os.path.isdir(p) and "site-packages" in p}
    return sorted({os.path.realpath(r) for r in roots if os.path.isdir(r)} - {"/"})
