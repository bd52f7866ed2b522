"""Kernel isolation helpers (ctypes; Python 3.11 has no os.unshare): user, network, mount, PID and IPC
namespaces, a read-only file-system view for chroot, capabilities, seccomp, Landlock, prctl. Every helper
returns False (or -1) when the kernel refuses; which layers hold in which deployment is in docs/sandbox.md.

Test switches, read once at import (the pool passes MARLFLOW_SANDBOX_* to its workers):
MARLFLOW_SANDBOX_NO_LANDLOCK=1 acts as if the kernel had no Landlock (the CI runs the hostile corpus so),
MARLFLOW_SANDBOX_NO_NAMESPACES=1 as if it refused every namespace (the pool then refuses to run programs
unless MARLFLOW_SANDBOX_ALLOW_WEAK=1).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import struct
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWUSER, _CLONE_NEWNET, _CLONE_NEWNS = 0x10000000, 0x40000000, 0x00020000
_CLONE_NEWPID, _CLONE_NEWIPC, _CLONE_THREAD = 0x20000000, 0x08000000, 0x00010000
_CLONE_NEWUTS, _CLONE_PARENT = 0x04000000, 0x00008000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_RELATIME = (
    1024,
    2048,
    4096,
    0x4000,
    1 << 18,
    1 << 21,
)
_NO_NAMESPACES = os.environ.get("MARLFLOW_SANDBOX_NO_NAMESPACES") == "1"
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 1, 38, 36
_SYS_LANDLOCK = (444, 445, 446)  # create_ruleset, add_rule, restrict_self (same on all Linux arches)


def _prctl(option: int, arg: int) -> bool:
    return _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0


def _unshare_network() -> bool:
    """Move this (single-threaded) process into a new, empty network namespace."""
    if not sys.platform.startswith("linux") or _NO_NAMESPACES:
        return False
    if os.geteuid() == 0 and _libc.unshare(_CLONE_NEWNET) == 0:
        return True
    return _new_user_namespace(_CLONE_NEWNET)


def _new_user_namespace(flags: int = 0) -> bool:
    """unshare(CLONE_NEWUSER | flags) with this process's ids mapped to themselves, so files it creates keep
    their owner and it does not see uid 65534 (overflow); the maps are optional, a refused write is harmless.
    False if the unshare is refused."""
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(_CLONE_NEWUSER | flags) != 0:
        return False
    for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with contextlib.suppress(OSError), open(f"/proc/self/{path}", "w") as f:
            f.write(text)
    return True


def _own_user_namespace() -> bool:
    """Move this (single-threaded, not chrooted) process into a new user namespace of its own, its ids
    mapped to themselves. Since Linux 5.14 RLIMIT_NPROC counts the tasks of a (user namespace, uid) pair
    (ucounts), so an unprivileged candidate that sets it after this counts only its own tasks, not every
    candidate of the caller's uid; the parent namespace's count is checked against the limit in force
    when this namespace was made (the caller's), never against the candidate's. False if refused."""
    if not sys.platform.startswith("linux") or _NO_NAMESPACES:
        return False
    return _new_user_namespace()


def _probe_user_namespace() -> bool:
    """Can a child of this process make a user namespace of its own (`_own_user_namespace`)?"""
    if not sys.platform.startswith("linux") or _NO_NAMESPACES:
        return False
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the probe child
        os._exit(0 if _libc.unshare(_CLONE_NEWUSER) == 0 else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _drop_capabilities() -> bool:
    """Clear the effective, permitted and inheritable capability sets (capset(2), version 3)."""
    header = struct.pack("Ii", 0x20080522, 0)
    data = bytes(24)  # two empty {effective, permitted, inheritable} u32 triples
    return _libc.capset(header, data) == 0


def _landlock_abi() -> int:
    if not sys.platform.startswith("linux") or os.environ.get("MARLFLOW_SANDBOX_NO_LANDLOCK") == "1":
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


# ------------------------------------------------------------------ namespaces, file-system view, seccomp

_ARCH = platform.machine()
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(_ARCH)


def _fork_isolated(sibling: bool = False, namespaces: bool = True) -> int:
    """fork(2) into new PID, mount, IPC and UTS namespaces: the child is PID 1 of its own namespace, so
    when it dies the kernel kills every process it left behind, and it cannot name (signal, renice, pin,
    ptrace) any process outside. Returns the child's pid in the parent, 0 in the child, -1 if the kernel
    refuses (nothing was forked then). `sibling`: CLONE_PARENT, the child is this process's parent's
    child (the zygote forks candidates its supervisor waits for). `namespaces=False`: no new namespace
    (the weak deployment). Only for a single-threaded caller: like os.fork, but through the raw clone
    syscall (no stack switch, so the child continues on a copy of this stack), with CPython's own fork
    hooks around it."""
    if _SYS_CLONE is None or (_NO_NAMESPACES and namespaces):
        return -1
    flags = (_CLONE_NEWPID | _CLONE_NEWNS | _CLONE_NEWIPC | _CLONE_NEWUTS if namespaces else 0) | 17
    if sibling:
        flags |= _CLONE_PARENT
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    pid = _libc.syscall(_SYS_CLONE, ctypes.c_ulong(flags), None, None, None, None)
    if pid == 0:
        api.PyOS_AfterFork_Child()
    else:
        api.PyOS_AfterFork_Parent()
    return pid


def _statvfs_flags(path: str) -> int:
    """Mount flags of `path` that a read-only remount must keep (an unprivileged user namespace may not
    clear them: EPERM)."""
    f = os.statvfs(path).f_flag
    pairs = ((2, _MS_NOSUID), (4, _MS_NODEV), (8, _MS_NOEXEC), (1024, _MS_NOATIME), (2048, _MS_NODIRATIME),
             (4096, _MS_RELATIME))  # fmt: skip
    return sum(ms for st, ms in pairs if f & st)


def _mount(src, target: str, fstype, flags: int, data) -> None:
    def enc(x):
        return None if x is None else x.encode()

    if _libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} on {target}: {os.strerror(err)}")


def _build_view(base: str, roots: list[str], devices: list[str]) -> str | None:
    """In this process's own (new, private) mount namespace, mount a tmpfs on `base` holding read-only
    bind mounts of `roots` (the Python install) and `devices` at their own paths, and a `w/` folder for
    working directories. A candidate that chroots into `base` sees nothing else: `os.stat`, `listdir` and
    `open` of any other path find nothing, whatever Landlock or the audit hook allow. Returns the path of
    `w/`, or None if the kernel refuses (the caller then runs without the view)."""
    if _NO_NAMESPACES or _libc.unshare(_CLONE_NEWNS) != 0:
        return None
    try:
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)
        hard = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        _mount("tmpfs", base, "tmpfs", hard, "mode=0755,size=1m")
        done: list[str] = []
        for src in sorted(roots) + devices:
            if any((src + "/").startswith(d + "/") for d in done):
                continue  # already inside a bound root
            dst = base + src
            if os.path.isdir(src):
                os.makedirs(dst, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                open(dst, "a").close()
            _mount(src, dst, None, _MS_BIND | _MS_REC, None)
            keep = _statvfs_flags(src)
            _mount(None, dst, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | keep, None)
            done.append(src)
        # The view itself is read-only; `w/` is its own tmpfs, mode --x for all: this process (which keeps
        # its capabilities) makes each job's folder there, a candidate (none) can neither list it nor leave
        # anything in it for the next job, even where it keeps uid 0.
        os.mkdir(base + "/w")
        _mount("tmpfs", base + "/w", "tmpfs", hard, "mode=0111")
        _mount(None, base, None, _MS_REMOUNT | _MS_RDONLY | hard, "mode=0755,size=1m")
        return base + "/w"
    except OSError:
        return None


# seccomp: syscalls the candidate never needs and whose effects reach past its limits or its namespaces
# (memory not counted by RLIMIT_AS, other processes' scheduling, new namespaces, exec, tracing, kernel
# interfaces that bypass the file checks). Refused with EPERM; clone only for threads; clone3 ENOSYS
# (glibc then creates threads with clone).
_SECCOMP_DENY = {
    "x86_64": (0xC000003E, {
        "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "shmat": 30, "msgget": 68, "semget": 64,
        "mq_open": 240, "setpriority": 141, "sched_setaffinity": 203, "sched_setparam": 142,
        "sched_setscheduler": 144, "sched_setattr": 314, "ioprio_set": 251, "ptrace": 101,
        "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_open": 434, "pidfd_send_signal": 424,
        "pidfd_getfd": 438, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "userfaultfd": 323, "perf_event_open": 298, "bpf": 321, "unshare": 272, "setns": 308, "mount": 165,
        "umount2": 166, "pivot_root": 155, "chroot": 161, "fork": 57, "vfork": 58, "execve": 59,
        "execveat": 322, "kexec_load": 246, "init_module": 175, "finit_module": 313, "keyctl": 250,
        "add_key": 248, "request_key": 249, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsmount": 432, "mount_setattr": 442, "kcmp": 312, "process_madvise": 440,
        "sync": 162, "syncfs": 306, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "flock": 73,
        "fadvise64": 221, "readahead": 187, "mincore": 27, "preadv2": 327, "pwritev2": 328,
        "cachestat": 451, "inotify_init": 253, "inotify_init1": 294, "inotify_add_watch": 254,
        "fanotify_init": 300, "sethostname": 170, "setdomainname": 171,
    }),
    "aarch64": (0xC00000B7, {
        "memfd_create": 279, "memfd_secret": 447, "shmget": 194, "shmat": 196, "msgget": 186, "semget": 190,
        "mq_open": 180, "setpriority": 140, "sched_setaffinity": 122, "sched_setparam": 118,
        "sched_setscheduler": 119, "sched_setattr": 274, "ioprio_set": 30, "ptrace": 117,
        "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_open": 434, "pidfd_send_signal": 424,
        "pidfd_getfd": 438, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "userfaultfd": 282, "perf_event_open": 241, "bpf": 280, "unshare": 97, "setns": 268, "mount": 40,
        "umount2": 39, "pivot_root": 41, "chroot": 51, "execve": 221, "execveat": 281, "kexec_load": 104,
        "init_module": 105, "finit_module": 273, "keyctl": 219, "add_key": 217, "request_key": 218,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsmount": 432, "mount_setattr": 442,
        "kcmp": 272, "process_madvise": 440,
        "sync": 81, "syncfs": 267, "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "flock": 32,
        "fadvise64": 223, "readahead": 213, "mincore": 232, "preadv2": 286, "pwritev2": 287,
        "cachestat": 451, "inotify_init1": 26, "inotify_add_watch": 27, "fanotify_init": 262,
        "sethostname": 161, "setdomainname": 162,
    }),
}  # fmt: skip
_CLONE3 = 435
_SYS_FCNTL = {"x86_64": 72, "aarch64": 25}.get(_ARCH)
# fcntl commands refused: record locks (classic and OFD: two jobs reading the same read-only file of the
# install could signal each other through them), leases and dnotify (another job's accesses).
_FCNTL_DENY = (5, 6, 7, 36, 37, 38, 1024, 1026)


def _seccomp_program() -> bytes | None:
    """The BPF filter for this architecture (None where the syscall table is not known here)."""
    if _ARCH not in _SECCOMP_DENY or _SYS_CLONE is None:
        return None
    arch, deny = _SECCOMP_DENY[_ARCH]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys, kill = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000
    nrs = sorted(set(deny.values()))
    # Layout: 0 ld arch; 1 jeq arch; 2 ld nr; 3 jge x32; 4.. jeq deny...; jeq clone; jeq clone3; jeq fcntl;
    # ret allow; [fcntl: ld args[1]; jeq cmd (to eperm)...; ret allow]; ld args[0]; jset CLONE_THREAD;
    # ret eperm (fall through); ret allow; ret enosys; ret kill.
    body = [(ld, 0, 0, 4), None, (ld, 0, 0, 0), None] + [None] * len(nrs) + [None, None, None]
    body.append((ret, 0, 0, allow))
    fcntl_at = len(body)
    body += [(ld, 0, 0, 24)] + [None] * len(_FCNTL_DENY) + [(ret, 0, 0, allow)]
    clone_at = len(body)
    body += [(ld, 0, 0, 16), (jset, 1, 0, _CLONE_THREAD)]
    deny_at = len(body)
    for i in range(len(_FCNTL_DENY)):
        at = fcntl_at + 1 + i
        body[at] = (jeq, deny_at - at - 1, 0, _FCNTL_DENY[i])
    body += [(ret, 0, 0, eperm), (ret, 0, 0, allow), (ret, 0, 0, enosys), (ret, 0, 0, kill)]
    allow_at, enosys_at, kill_at = deny_at + 1, deny_at + 2, deny_at + 3
    body[1] = (jeq, 0, kill_at - 2, arch)
    x32 = 0x40000000 if _ARCH == "x86_64" else 0xFFFFFFFF
    body[3] = (jge, deny_at - 4, 0, x32)
    for i, nr in enumerate(nrs):
        at = 4 + i
        body[at] = (jeq, deny_at - at - 1, 0, nr)
    at = 4 + len(nrs)
    body[at] = (jeq, clone_at - at - 1, 0, _SYS_CLONE)
    body[at + 1] = (jeq, enosys_at - at - 2, 0, _CLONE3)
    body[at + 2] = (jeq, fcntl_at - at - 3, 0, _SYS_FCNTL)
    del allow_at
    return b"".join(struct.pack("=HBBI", *ins) for ins in body)


_SECCOMP = _seccomp_program()


def _seccomp() -> bool:
    """Install the filter on this process and everything it forks (no_new_privs first, as unprivileged
    seccomp requires)."""
    if _SECCOMP is None:
        return False
    buf = ctypes.create_string_buffer(_SECCOMP, len(_SECCOMP))
    prog = struct.pack("=HxxxxxxQ", len(_SECCOMP) // 8, ctypes.addressof(buf))
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    return _libc.prctl(22, ctypes.c_ulong(2), ctypes.c_char_p(prog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER
