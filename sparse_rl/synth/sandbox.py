"""Run untrusted Python in a subprocess with hard limits.

What is enforced, and where (`run_python(...).enforced` reports the platform-dependent ones):

  kernel, always (POSIX rlimits set in the child before exec, inherited by everything it spawns):
    - RLIMIT_CPU     CPU seconds; SIGXCPU then SIGKILL               -> status "cpu_limit"
    - RLIMIT_AS      address space; allocations fail (MemoryError)   -> status "memory_limit"
    - RLIMIT_FSIZE   largest file the child may write, incl. its captured stdout/stderr, so an
                     output flood or a disk-filling loop stops at the cap -> "output_limit"
    - RLIMIT_NPROC   processes+threads of the child's uid (fork bombs): `nproc` more than the uid
                     runs at launch (the kernel counts per uid, not per process tree)
    - RLIMIT_NOFILE, RLIMIT_CORE=0
  parent, always:
    - wall clock: after `wall_s` the child's whole process group (its own session) is SIGKILLed
      -> "timeout"; the group is also killed after a normal exit, so no background child survives.
    - clean environment (only PATH, LANG, HOME=cwd), private temporary working directory that is
      deleted afterwards, `python -I` (no user site, no PYTHON* variables); stdout truncated to
      `output_bytes` when read back.
  kernel, where the platform allows:
    - network: a new, empty network namespace (unshare(CLONE_NEWNET); as root directly, otherwise
      with a user namespace). `enforced["network_namespace"]` says whether it took.
    - writes: a private mount namespace in which every mount but the working directory (and /dev,
      /proc, /sys) is read-only, so writes elsewhere fail with EROFS even in world-writable /tmp or
      /dev/shm. `enforced["readonly_mounts"]` says whether it took.
    - uid: as root the child drops to uid/gid 65534 (nobody), because Linux never applies
      RLIMIT_NPROC to uid 0; it then needs an interpreter that user can execute (we probe
      sys.executable, then python3 on PATH). `enforced["uid_drop"]` says whether it did.
  in-process guard (a `sys.addaudithook` installed before the user code; hooks cannot be removed,
  and this one lives in a closure, resolving paths with posix functions captured before the user
  code runs, so monkeypatching os/os.path does not fool it):
    - writes, renames, deletes, symlinks, chmods outside the working directory raise PermissionError
      (symlinks resolved; dir_fd and fd arguments resolved through /proc/self/fd) -> "blocked";
      also refused: '..' in relative paths given to open (the open event hides dir_fd), opening
      directories outside, moving symlinks, gc heap introspection, sys.settrace/setprofile;
    - sockets (connect/bind/sendto/getaddrinfo...) raise, for platforms without a network namespace;
    - subprocess/exec/spawn/os.system and importing ctypes raise, so no child program or foreign
      call escapes the guard;
    - os.fork is also blocked when RLIMIT_NPROC cannot bind (root without a uid to drop to), and
      the guard cannot be turned off there.
  The guard is a second layer against model-written code, not a security boundary on its own;
  the kernel mechanisms are.
  Not confined: reads (the child may read whatever its uid may read), CPU/memory of other
  processes (no cgroups), and, without a network namespace, raw syscalls that bypass Python's
  socket module. As root the interpreter is the first one uid 65534 can run (often the system
  python3, which lacks the project's packages): tasks for this tool need only the standard library.
  `preexec_fn` is used, so call `run_python` from one thread at a time.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

NOBODY = 65534
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MOUNT_OPTS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
               "relatime": 1 << 21}
# Left writable: device nodes (/dev/null must stay writable) and kernel interfaces, whose writes
# the dropped uid's permissions already govern.
_KEEP_RW = (b"/dev", b"/dev/pts", b"/proc", b"/sys")


@dataclasses.dataclass
class Limits:
    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    nproc: int = 32              # processes+threads the child may add to what its uid already runs
    output_bytes: int = 16_000
    file_bytes: int = 2_000_000
    nofile: int = 64


@dataclasses.dataclass
class ExecResult:
    status: str  # ok | error | timeout | cpu_limit | memory_limit | output_limit | blocked (guard or EROFS)
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool
    enforced: dict

    def summary(self, max_chars: int = 2000) -> str:
        """What a tool call shows the model: status line, then stdout and stderr (clipped)."""
        parts = [] if self.status == "ok" else [f"[sandbox: {self.status}, exit code {self.returncode}]"]
        if self.stdout:
            parts.append(self.stdout[:max_chars] + ("\n[... output truncated]" if self.truncated or len(self.stdout) > max_chars else ""))
        if self.stderr and self.status != "ok":
            parts.append("stderr:\n" + self.stderr[-max_chars:])
        return "\n".join(parts) if parts else "(no output)"


_GUARD = r'''
def _install(argv):
    # Everything the hook needs is bound here, in a closure the user code cannot reach (the module
    # globals are deleted below; gc introspection is refused), and path resolution uses the C-level
    # posix functions captured now, so monkeypatching os/os.path cannot fool it.
    import posix, sys, stat, pathlib
    lstat, readlink, getcwd, fsdecode = posix.lstat, posix.readlink, posix.getcwd, __import__("os").fsdecode
    S_ISLNK, S_ISDIR = stat.S_ISLNK, stat.S_ISDIR
    PE, isinstance_, str_, bytes_, int_, type_ = PermissionError, isinstance, str, bytes, int, type
    W = posix.O_WRONLY | posix.O_RDWR | posix.O_APPEND | posix.O_CREAT | posix.O_TRUNC
    safe_path_types = (pathlib.PosixPath, pathlib.PurePosixPath)

    def real(p):
        if not p.startswith("/"):
            p = getcwd() + "/" + p
        todo, resolved, hops = [x for x in p.split("/") if x], "", 0
        while todo:
            name = todo.pop(0)
            if name == ".":
                continue
            if name == "..":
                resolved = resolved.rsplit("/", 1)[0]
                continue
            cand = resolved + "/" + name
            try:
                link = S_ISLNK(lstat(cand).st_mode)
            except OSError:
                link = False
            if link:
                hops += 1
                if hops > 40:
                    raise PE("sandbox: too many symbolic links")
                target = readlink(cand)
                if target.startswith("/"):
                    resolved = ""
                todo = [x for x in target.split("/") if x] + todo
            else:
                resolved = cand
        return resolved or "/"

    root = real(getcwd())

    def text(p):
        if isinstance_(p, int_):
            return real(readlink("/proc/self/fd/%d" % p))
        if isinstance_(p, (str_, bytes_)):
            return fsdecode(p)
        if type_(p) in safe_path_types:
            return str_(p)
        raise PE("sandbox: paths must be str, bytes or pathlib paths")

    def inside(p, dir_fd=None):
        t = text(p)
        if dir_fd not in (None, -1, -100) and not t.startswith("/"):
            t = readlink("/proc/self/fd/%d" % dir_fd) + "/" + t
        rp = real(t)
        return rp == root or rp.startswith(root + "/")

    def deny(msg):
        raise PE("sandbox: " + msg)

    # event -> (positions of path arguments, positions of dir_fd arguments)
    paths = {"os.remove": ((0,), (1,)), "os.rename": ((0, 1), (2, 3)), "os.mkdir": ((0,), (2,)),
             "os.rmdir": ((0,), (1,)), "os.symlink": ((1,), (2,)), "os.link": ((0, 1), (2, 3)),
             "os.truncate": ((0,), ()), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
             "os.utime": ((0,), (3,)), "os.mkfifo": ((0,), (2,)), "os.mknod": ((0,), (3,)),
             "shutil.rmtree": ((0,), ()), "shutil.copyfile": ((1,), ()), "os.chflags": ((0,), ()),
             "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ())}
    procs = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile", "pty.spawn"}
    nets = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
            "socket.gethostbyname", "socket.gethostbyaddr"}
    introspect = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "ctypes.dlopen", "ctypes.dlsym",
                  "ctypes.cdata", "sys.setprofile", "sys.settrace"}
    block_fork = argv[2] == "1"

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance_(path, int_):
                return
            wr = (isinstance_(flags, int_) and flags & W) or (isinstance_(mode, str_) and any(c in mode for c in "wax+"))
            # The open event does not carry dir_fd, so a relative path is judged against the cwd;
            # refusing '..' in relative paths stops climbing out of a directory fd.
            if not isinstance_(path, int_) and not text(path).startswith("/") and ".." in text(path).split("/"):
                deny("'..' in a relative path")
            if not inside(path):
                if wr:
                    deny("write outside the working directory: " + text(path))
                try:  # a directory fd opened outside could anchor *at() calls (dir_fd) the hook cannot see
                    is_dir = S_ISDIR(lstat(real(text(path))).st_mode)
                except OSError:
                    is_dir = False
                if is_dir:
                    deny("opening directories outside the working directory")
        elif event in paths:
            pos, fds = paths[event]
            for k, i in enumerate(pos):
                dfd = args[fds[min(k, len(fds) - 1)]] if fds and fds[-1] < len(args) else None
                if i < len(args) and args[i] is not None and not inside(args[i], dfd):
                    deny(event + " outside the working directory: " + str_(args[i]))
            if event == "os.rename":
                d, _, b = text(args[0]).rpartition("/")
                try:
                    link = S_ISLNK(lstat(real(d or ".") + "/" + b).st_mode)
                except OSError:
                    link = False
                if link:
                    deny("moving symbolic links is disabled (a relative link would point elsewhere)")
            if event == "os.symlink" and not inside(real(text(args[1]).rsplit("/", 1)[0] + "/" + text(args[0]))
                                                    if not text(args[0]).startswith("/") else args[0]):
                deny("symlink pointing outside the working directory")
        elif event in nets:
            deny("network access is disabled")
        elif event in procs:
            deny("starting programs is disabled")
        elif event in introspect or (event == "import" and args[0] in ("ctypes", "_ctypes")):
            deny(event + " is disabled")
        elif block_fork and event in ("os.fork", "os.forkpty"):
            deny("fork is disabled on this platform (RLIMIT_NPROC cannot bind)")

    with open(argv[1]) as fh:
        src = fh.read()
    sys.addaudithook(hook)
    return src


_src = _install(__import__("sys").argv)
del _install
__import__("sys").argv = ["main.py"]
_code = compile(_src, "main.py", "exec")
del _src
_g = {"__name__": "__main__", "__builtins__": __builtins__}
exec(_code, _g)
'''


@lru_cache(maxsize=1)
def _libc():
    # Loaded in the parent: importing or dlopen-ing between fork and exec could deadlock.
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
        libc.unshare.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):  # not Linux/glibc-like: no namespaces, the other layers still apply
        return None
    return libc


def _mounts() -> list[tuple[bytes, int]]:
    """(mount point, per-mount flags to keep) for every mount, read in the parent."""
    import re

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


def _count_tasks(uid: int) -> int:
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


def _preexec(limits: Limits, drop_uid: bool, want_netns: bool, nproc: int | None = None,
             rw_dir: str | Path | None = None):
    """Runs in the child between fork and exec: namespaces first (needs privileges), then rlimits,
    then the uid drop. It must not allocate much or take locks; it only makes syscalls.

    With `rw_dir`, the child also gets a private mount namespace in which every mount except
    `rw_dir` (bind-mounted onto itself) and _KEEP_RW is remounted read-only. Mount calls are made
    only after checking that the namespace really is new and that propagation to the host is cut
    (MS_PRIVATE), so they can never touch the host's mounts.
    """
    mem = limits.memory_mb * 1024 * 1024
    libc = _libc()
    mounts = _mounts() if rw_dir is not None else []
    wd = os.fsencode(str(rw_dir)) if rw_dir is not None else b""

    def namespaces():
        user = 0 if os.geteuid() == 0 else CLONE_NEWUSER
        mnt_before = os.readlink("/proc/self/ns/mnt")
        if rw_dir is not None and libc.unshare(user | CLONE_NEWNET | CLONE_NEWNS) == 0:
            if (os.readlink("/proc/self/ns/mnt") != mnt_before
                    and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0
                    and libc.mount(wd, wd, None, MS_BIND | MS_REC, None) == 0):
                for mp, keep in mounts:
                    if mp != wd and mp not in _KEEP_RW and not mp.startswith((b"/proc/", b"/sys/")):
                        libc.mount(None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None)
                os.chdir(wd)  # the cwd set before us is the directory under the new bind mount
        else:
            libc.unshare(user | CLONE_NEWNET)

    def fn():
        if want_netns and libc is not None:
            try:  # best effort: platform_support() reports what actually took
                namespaces()
            except Exception:
                pass
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.nofile, limits.nofile))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        n = limits.nproc if nproc is None else nproc
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
        if drop_uid:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)

    return fn


@lru_cache(maxsize=1)
def platform_support() -> dict:
    """Probe once what this machine lets us enforce: which interpreter, uid drop, net namespace."""
    root = os.geteuid() == 0
    candidates = [sys.executable] + [p for p in (shutil.which("python3"), "/usr/bin/python3") if p]
    python, drop = sys.executable, False
    if root:
        for cand in dict.fromkeys(candidates):
            try:
                r = subprocess.run([cand, "-I", "-c", "print(1)"], capture_output=True, timeout=10,
                                   preexec_fn=_preexec(Limits(), True, False), env={"PATH": "/usr/bin:/bin"})
            except Exception:
                continue
            if r.returncode == 0 and r.stdout.strip() == b"1":
                python, drop = cand, True
                break
    netns = ro = False
    wd, outside = tempfile.mkdtemp(prefix="sparse-rl-probe-"), tempfile.mkdtemp(prefix="sparse-rl-probe-")
    try:
        os.chmod(wd, 0o777)
        os.chmod(outside, 0o777)  # writable for any uid: only the mount namespace can refuse
        code = ("import os\nprint(os.readlink('/proc/self/ns/net'))\nopen('in', 'w').write('x')\n"
                f"try:\n    open({os.path.join(outside, 'out')!r}, 'w').write('x')\nexcept OSError:\n    print('ro')\n")
        mine = os.readlink("/proc/self/ns/net")
        r = subprocess.run([python, "-I", "-c", code], capture_output=True, timeout=10, cwd=wd,
                           preexec_fn=_preexec(Limits(), drop, True, rw_dir=wd), env={"PATH": "/usr/bin:/bin"})
        lines = r.stdout.decode().split()
        netns = r.returncode == 0 and bool(lines) and lines[0] != mine
        ro = (r.returncode == 0 and lines[-1:] == ["ro"] and os.path.exists(os.path.join(wd, "in"))
              and not os.path.exists(os.path.join(outside, "out")))
    except Exception:
        pass
    finally:
        shutil.rmtree(wd, ignore_errors=True)
        shutil.rmtree(outside, ignore_errors=True)
    return {"python": python, "uid_drop": drop, "network_namespace": netns, "readonly_mounts": ro,
            "nproc_limit": (not root) or drop}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (its session) and reap the leader; repeat while
    members remain (a forking group may need a few rounds; orphans are reaped by init)."""
    pgid = proc.pid
    deadline = time.monotonic() + 10.0  # zombies linger until init reaps them; some inits are slow
    i = 0
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
        if i == 0:
            proc.wait()
        if not _group_alive(pgid):
            break
        i += 1
        time.sleep(0.01)
    proc.wait()


def run_python(code: str, limits: Limits | None = None, workdir: str | Path | None = None,
               guard: bool = True) -> ExecResult:
    """Run `code` as `main.py` in `workdir` (a fresh private temp dir if None) under `limits`.

    A given `workdir` is reused (a stateful tool keeps files between calls) and must be private to
    the caller; it is made writable for the sandbox uid.
    """
    limits = limits or Limits()
    sup = platform_support()
    if not sup["nproc_limit"]:
        guard = True  # nothing else would stop a fork bomb here: never run without the guard
    own_dir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="sparse-rl-sbx-")) if own_dir else Path(workdir)
    cap = Path(tempfile.mkdtemp(prefix="sparse-rl-cap-"))
    try:
        src = cap / "main.py"
        src.write_text(code)
        os.chmod(cap, 0o755)
        os.chmod(src, 0o644)
        if sup["uid_drop"]:
            for p in [wd, *wd.rglob("*")]:
                os.lchown(p, NOBODY, NOBODY)
        with open(cap / "stdout", "wb") as out, open(cap / "stderr", "wb") as err:
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(wd)}
            block_fork = "0" if sup["nproc_limit"] else "1"
            argv = [sup["python"], "-I", "-X", "utf8"]
            argv += ["-c", _GUARD, str(src), block_fork] if guard else [str(src)]
            # RLIMIT_NPROC counts every task of the uid, so the budget is on top of what it runs now.
            nproc = limits.nproc + _count_tasks(NOBODY if sup["uid_drop"] else os.getuid())
            t0 = time.monotonic()
            proc = subprocess.Popen(argv, cwd=wd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True,
                                    preexec_fn=_preexec(limits, sup["uid_drop"], True, nproc,
                                                        wd if sup["readonly_mounts"] else None))
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc)  # also kills stragglers left behind by a normal exit
            wall = time.monotonic() - t0
        out_size = (cap / "stdout").stat().st_size
        with open(cap / "stdout", "rb") as fh:
            stdout = fh.read(limits.output_bytes).decode("utf-8", "replace")
        with open(cap / "stderr", "rb") as fh:
            fh.seek(max(0, (cap / "stderr").stat().st_size - limits.output_bytes))
            stderr = fh.read().decode("utf-8", "replace")
        rc = proc.returncode
        truncated = out_size > limits.output_bytes
        if timed_out:
            status = "timeout"
        elif rc in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out:
            status = "cpu_limit"
        elif "MemoryError" in stderr:
            status = "memory_limit"
        elif out_size >= limits.file_bytes or "File too large" in stderr:
            status = "output_limit"
        elif "PermissionError: sandbox:" in stderr or "Read-only file system" in stderr:
            status = "blocked"
        elif rc != 0:
            status = "error"
        else:
            status = "ok"
        if truncated and status == "ok":
            status = "output_limit"
        enforced = {k: sup[k] for k in ("uid_drop", "network_namespace", "readonly_mounts", "nproc_limit")}
        enforced["guard"] = guard
        return ExecResult(status, rc, stdout, stderr, round(wall, 3), truncated, enforced)
    finally:
        shutil.rmtree(cap, ignore_errors=True)
        if own_dir:
            shutil.rmtree(wd, ignore_errors=True)
