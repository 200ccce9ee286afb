"""The kernel side of the sandbox: what the child does between fork and exec, and the per-sandbox
uid and working directory.

Process tree of one call (Linux, where unshare is allowed):

    parent --Popen--> A: unshare(NEWPID|NEWNS|NEWNET[|NEWUSER]), fork, wait, exit with B's status
                      `-> B: PID 1 of the new PID namespace: mounts, rlimits, setuid, PDEATHSIG,
                             then exec the interpreter (which installs seccomp before the user code)

When B exits, the kernel kills every other process of its PID namespace, `setsid()` or not, so
nothing the code started outlives the call. When the parent kills A (wall clock), B gets SIGKILL
through PR_SET_PDEATHSIG, and then the same. Without a PID namespace we fall back to killing the
process group (which a `setsid()` escapes: `enforced["pid_namespace"]` says which held).

A must not return from the preexec hook (it would exec the program too); B returns and is exec'd.
The hook runs between fork and exec: it only makes syscalls and allocates little.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import tempfile
import threading
import weakref
from functools import lru_cache
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
_MOUNT_OPTS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
               "relatime": 1 << 21}
# Left writable: device nodes (/dev/null must stay writable) and kernel interfaces, whose writes
# the dropped uid's permissions already govern.
_KEEP_RW = (b"/dev", b"/dev/pts", b"/proc", b"/sys")

# Sandbox uids: 2**30 + (our pid) * 256 + slot. Live pids are unique on the host and below 2**22,
# so no two sandboxes alive at once, in this process or another, share a uid; a slot is reused
# only after its sandbox closed, when none of its processes is left (see the module docstring).
UID_BASE, UID_SLOTS = 1 << 30, 256


@lru_cache(maxsize=1)
def libc():
    # Loaded in the parent: importing or dlopen-ing between fork and exec could deadlock.
    import ctypes

    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
        lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.unshare.argtypes = [ctypes.c_int]
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    except (OSError, AttributeError):  # not Linux/glibc-like: no namespaces, the other layers still apply
        return None
    return lib


class _UidPool:
    def __init__(self):
        self.lock, self.used = threading.Lock(), set()

    def take(self) -> int:
        with self.lock:
            slot = next((s for s in range(UID_SLOTS) if s not in self.used), None)
            if slot is None:
                raise RuntimeError(f"sandbox: more than {UID_SLOTS} sandboxes open at once in one process")
            self.used.add(slot)
        return UID_BASE + (os.getpid() % (1 << 22)) * UID_SLOTS + slot

    def give(self, uid: int) -> None:
        with self.lock:
            self.used.discard((uid - UID_BASE) % UID_SLOTS)


UIDS = _UidPool()


def mount_tmpfs(path: Path, size_mb: int, max_files: int, uid: int | None) -> bool:
    """Mount a size- and inode-capped tmpfs on `path` (root only); True if it took."""
    lib = libc()
    if lib is None or os.geteuid() != 0:
        return False
    opts = f"size={int(size_mb)}m,nr_inodes={int(max_files) + 1},mode=0700"  # +1: the root directory
    if uid is not None:
        opts += f",uid={uid},gid={uid}"
    return lib.mount(b"tmpfs", os.fsencode(str(path)), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()) == 0


def _cleanup(path: Path, mounted: bool, uid: int | None) -> None:
    if mounted and libc() is not None:
        libc().umount2(os.fsencode(str(path)), MNT_DETACH)
    shutil.rmtree(path, ignore_errors=True)
    if uid is not None:
        UIDS.give(uid)


class Workdir:
    """A sandbox's private working directory, kept across the calls of an episode, removed by
    `close()` (or at garbage collection / interpreter exit).

    With a uid drop it gets a uid of its own (`uid`) and mode 0700, so other sandboxes can neither
    list it nor signal its processes. As root it is its own tmpfs of `disk_mb` MiB and `max_files`
    entries (`disk_limited`), so a call cannot fill the host's disk; elsewhere only RLIMIT_FSIZE
    (per file) applies.
    """

    def __init__(self, disk_mb: int, max_files: int, uid_drop: bool, tmpfs: bool):
        self.path = Path(tempfile.mkdtemp(prefix="sparse-rl-sbx-"))
        self.uid = UIDS.take() if uid_drop else None
        self.disk_limited = tmpfs and mount_tmpfs(self.path, disk_mb, max_files, self.uid)
        if self.uid is not None:
            os.chown(self.path, self.uid, self.uid)
        os.chmod(self.path, 0o700)
        self._finalizer = weakref.finalize(self, _cleanup, self.path, self.disk_limited, self.uid)

    def chown_all(self) -> None:
        if self.uid is not None:
            for p in [self.path, *self.path.rglob("*")]:
                os.lchown(p, self.uid, self.uid)

    def full(self) -> bool:
        """No room left for another page or another file (only meaningful when disk_limited)."""
        if not self.disk_limited:
            return False
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize < 16384 or st.f_favail == 0

    def close(self) -> None:
        self._finalizer()


def mounts() -> list[tuple[bytes, int]]:
    """(mount point, per-mount flags to keep) for every mount, read in the parent."""
    out = []
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                f = line.split()
                mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), f[4])
                out.append((os.fsencode(mp), sum(_MOUNT_OPTS.get(o, 0) for o in f[5].split(","))))
    except OSError:
        pass
    return out


def count_tasks(uid: int) -> int:
    """Processes+threads whose real uid is `uid` (what RLIMIT_NPROC counts against)."""
    n = 0
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: the budget is then absolute
        return 0
    for d in entries:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields.get("Threads", "1"))
        except (OSError, KeyError, ValueError):
            continue
    return n


def _reap_and_exit(pid: int) -> None:
    """A: wait for B and leave with its status (the same signal, or the same exit code)."""
    os.closerange(3, 1 << 16)  # the parent's exec-error pipe among them: Popen returns once B execs
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(255)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(sig, signal.SIG_DFL)
        except (ValueError, OSError):
            pass
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 255)


def preexec(limits, uid: int | None, namespaces: bool, rw_dir: Path | None, nproc: int):
    """The hook run in the child between fork and exec: namespaces (and the fork into the new PID
    namespace) first, as they need privileges; then mounts, rlimits, the uid drop, PDEATHSIG.

    With `rw_dir`, the child gets a private mount namespace in which every mount except `rw_dir`
    (bind-mounted onto itself) and _KEEP_RW is remounted read-only, and a /proc of its own PID
    namespace (so it sees no host process). Mount calls are made only after checking that the
    namespace really is new and that propagation to the host is cut (MS_PRIVATE), so they can
    never touch the host's mounts.
    """
    mem = limits.memory_mb * 1024 * 1024
    lib = libc()
    all_mounts = mounts() if rw_dir is not None else []
    wd = os.fsencode(str(rw_dir)) if rw_dir is not None else b""

    def remount(in_pid_ns: bool):
        if (os.readlink("/proc/self/ns/mnt") == mnt_before
                or lib.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0
                or lib.mount(wd, wd, None, MS_BIND | MS_REC, None) != 0):
            return
        for mp, keep in all_mounts:
            if mp != wd and mp not in _KEEP_RW and not mp.startswith((b"/proc/", b"/sys/")):
                lib.mount(None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None)
        if in_pid_ns:
            lib.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        os.chdir(wd)  # the cwd set before us is the directory under the new bind mount

    def fn():
        nonlocal mnt_before
        in_pid_ns = False
        if namespaces and lib is not None:
            user = 0 if os.geteuid() == 0 else CLONE_NEWUSER
            mnt_before = os.readlink("/proc/self/ns/mnt")
            flags = user | CLONE_NEWNET | (CLONE_NEWNS if rw_dir is not None else 0)
            # best effort, most to least: platform_support() reports what actually took
            new_pid = lib.unshare(flags | CLONE_NEWPID) == 0
            if new_pid or lib.unshare(flags) == 0 or lib.unshare(user | CLONE_NEWNET) == 0:
                if new_pid:
                    pid = os.fork()
                    if pid:
                        _reap_and_exit(pid)
                    in_pid_ns = True
                if rw_dir is not None:
                    try:
                        remount(in_pid_ns)
                    except OSError:
                        pass
        # In a PID namespace the program is its init, which ignores SIGXCPU: make the CPU limit a
        # SIGKILL (the kernel sends that at the hard limit) by setting both limits equal.
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s if in_pid_ns else limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.nofile, limits.nofile))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        if in_pid_ns:  # after setuid, which clears it; before exec, so before any user code
            lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    mnt_before = ""
    return fn
