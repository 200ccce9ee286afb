"""Run untrusted Python in a subprocess with hard limits.

What is enforced, and where (`run_python(...).enforced` reports the platform-dependent layers;
the process tree is drawn in sandbox_proc.py):

  kernel, always (POSIX rlimits set in the child before exec, inherited by everything it spawns):
    - RLIMIT_CPU     CPU seconds                                     -> status "cpu_limit"
    - RLIMIT_AS      address space; allocations fail (MemoryError)   -> status "memory_limit"
    - RLIMIT_FSIZE   largest file the child may write, incl. its captured stdout/stderr, so an
                     output flood on either stream stops at the cap  -> "output_limit"
    - RLIMIT_NPROC   processes+threads of the child's uid (fork bombs)
    - RLIMIT_NOFILE, RLIMIT_CORE=0
  kernel, where the platform allows (Linux; as root directly, otherwise in a user namespace):
    - processes: the child is PID 1 of a new PID namespace; when it exits (or the parent kills it
      at the wall clock) the kernel kills every process it started, `setsid()` or not, and it can
      see and signal no process outside (`pid_namespace`);
    - network: a new, empty network namespace (`network_namespace`);
    - writes: a private mount namespace where every mount but the working directory (and /dev,
      /proc, /sys) is read-only, so writes elsewhere fail with EROFS even in world-writable /tmp
      (`readonly_mounts`); /proc is that of the new PID namespace;
    - uid: as root the child runs as a uid of its own sandbox (2**30 + ..., see sandbox_proc.py),
      so RLIMIT_NPROC binds (Linux never applies it to uid 0) and sandboxes cannot read each
      other's working directories (mode 0700) or signal each other (`uid_drop`);
    - disk: as root the working directory is a tmpfs of `disk_mb` MiB and `max_files` entries, so
      the total a sandbox writes is capped, not only each file (`disk_limit`) -> "disk_limit";
    - seccomp (x86-64, aarch64; installed by the interpreter before the user code, inherited by
      its children): no exec of any program, no unix sockets, no new namespaces, no mount, ptrace,
      bpf... (seccomp.py; `seccomp`) -> "blocked".
  parent, always:
    - wall clock: after `wall_s` the child is SIGKILLed (with it its PID namespace, or else its
      process group) -> "timeout".
    - clean environment (only PATH, LANG, HOME=cwd), `python -I`; stdout/stderr truncated to
      `output_bytes` when read back.
    - the status comes from the exit status, the exception type the interpreter itself reports
      through a pipe, and the disk's fill level, never from the text the program printed.
  in-process guard (an audit hook installed before the user code; sandbox_guard.py): writes,
  renames, deletes, symlinks, chmods outside the working directory, sockets, subprocesses,
  ctypes and gc introspection raise PermissionError -> "blocked". A second layer for platforms
  without the kernel ones, not a boundary on its own: it can be bypassed (e.g. by C functions
  that raise no audit event), which is why exec and sockets are refused by seccomp.

  Not confined: reads (the child may read whatever an unprivileged uid may read on the host,
  e.g. world-readable files in /etc or /tmp), CPU and memory of the host as a whole (no cgroups;
  the rlimits are per process), and, without the kernel layers, everything the guard misses.
  As root the interpreter is the first one an unprivileged uid can run (often the system
  python3, which lacks the project's packages): tasks for this tool need only the standard
  library. `preexec_fn` is used, so call `run_python` from one thread at a time.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from sparse_rl.synth import sandbox_proc as sp
from sparse_rl.synth.sandbox_guard import BOOT
from sparse_rl.synth.seccomp import build_filter

@dataclasses.dataclass
class Limits:
    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    nproc: int = 32              # processes+threads the child may add to what its uid already runs
    output_bytes: int = 16_000
    file_bytes: int = 2_000_000  # largest single file, captured stdout/stderr included
    nofile: int = 64
    disk_mb: int = 64            # the working directory's total size (as root: its tmpfs)
    max_files: int = 2000        # ... and its number of files and directories


@dataclasses.dataclass
class ExecResult:
    status: str  # ok | error | timeout | cpu_limit | memory_limit | output_limit | disk_limit | blocked
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




def _probe_python(root: bool) -> tuple[str, bool]:
    """The interpreter to run, and whether the uid drop works with it (root only)."""
    if not root:
        return sys.executable, False
    candidates = [sys.executable] + [p for p in (shutil.which("python3"), "/usr/bin/python3") if p]
    uid = sp.UIDS.take()
    try:
        for cand in dict.fromkeys(candidates):
            try:
                r = subprocess.run([cand, "-I", "-c", "import ctypes; print(1)"], capture_output=True, timeout=60,
                                   preexec_fn=sp.preexec(Limits(), uid, False, None, 64), env={"PATH": "/usr/bin:/bin"})
            except Exception:
                continue
            if r.returncode == 0 and r.stdout.strip() == b"1":
                return cand, True
    finally:
        sp.UIDS.give(uid)
    return sys.executable, False


def _probe_tmpfs() -> bool:
    d = Path(tempfile.mkdtemp(prefix="sparse-rl-probe-"))
    try:
        ok = sp.mount_tmpfs(d, 1, 4, None)
        if ok:
            sp.libc().umount2(os.fsencode(str(d)), sp.MNT_DETACH)
        return ok
    finally:
        shutil.rmtree(d, ignore_errors=True)


@lru_cache(maxsize=1)
def platform_support() -> dict:
    """Probe once what this machine lets us enforce, by running one program through the real path."""
    root = os.geteuid() == 0
    python, drop = _probe_python(root)
    prog = build_filter()
    sup = {"python": python, "uid_drop": drop, "nproc_limit": (not root) or drop, "disk_limit": _probe_tmpfs(),
           "namespaces": sp.libc() is not None, "readonly_mounts": sp.libc() is not None,
           "seccomp_filter": prog.hex() if prog else ""}
    outside = Path(tempfile.mkdtemp(prefix="sparse-rl-probe-"))
    os.chmod(outside, 0o777)  # writable for any uid: only the mount namespace can refuse
    code = ("import os\nprint(os.readlink('/proc/self/ns/net'))\nprint(os.getpid())\nopen('in', 'w').write('x')\n"
            f"try:\n    open({str(outside / 'out')!r}, 'w').write('x')\nexcept OSError:\n    print('ro')\n"
            "print(os.path.exists('in'))\n")
    mine = os.readlink("/proc/self/ns/net") if os.path.exists("/proc/self/ns/net") else ""
    got = {"network_namespace": False, "pid_namespace": False, "seccomp": False}
    try:
        for ro in ([True, False] if sup["readonly_mounts"] else [False]):
            sup["readonly_mounts"] = ro
            wd = open_workdir(Limits(disk_mb=1, max_files=16), sup)
            try:
                r = _execute(code, Limits(cpu_s=10, wall_s=60.0), wd, False, sup)  # generous: a loaded CI box
            finally:
                wd.close()
            lines = r.stdout.split()
            if r.returncode == 0 and len(lines) >= 3:
                ro_ok = lines[2:] == ["ro", "True"] and not (outside / "out").exists()
                got = {"network_namespace": lines[0] != mine, "pid_namespace": lines[1] == "1",
                       "seccomp": r.enforced["seccomp"]}
                if ro_ok or not ro:
                    sup["readonly_mounts"] = ro_ok
                    break
    except Exception:
        sup["readonly_mounts"] = False
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    sup.update(got)
    sup["namespaces"] = got["network_namespace"] or got["pid_namespace"]
    if not got["seccomp"]:
        sup["seccomp_filter"] = ""
    return sup


ENFORCED_KEYS = ("uid_drop", "pid_namespace", "network_namespace", "readonly_mounts", "nproc_limit", "seccomp")


def open_workdir(limits: Limits | None = None, sup: dict | None = None) -> sp.Workdir:
    """A private working directory for a sandbox that keeps files between calls (close() it)."""
    limits = limits or Limits()
    sup = sup or platform_support()
    return sp.Workdir(limits.disk_mb, limits.max_files, sup["uid_drop"], sup["disk_limit"])


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group and reap the leader; repeat while members remain. With a
    PID namespace this is the wall-clock kill (PDEATHSIG takes the namespace down); without one it
    is the only cleanup, and a member that called setsid() escapes it."""
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
        i += 1
        time.sleep(0.01)
    proc.wait()


def _read_report(fd: int) -> dict:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 1 << 16).decode("utf-8", "replace")
    except (BlockingIOError, OSError):
        data = ""
    finally:
        os.close(fd)
    rep = {"seccomp": False, "exc": None, "errno": None, "guard": False}
    for line in data.splitlines():
        f = line.split()
        if f == ["seccomp"]:
            rep["seccomp"] = True
        elif len(f) == 4 and f[0] == "exc":
            rep.update(exc=f[1], errno=int(f[2]) if f[2].isdigit() else None, guard=f[3] == "1")
    return rep


def _status(rc: int | None, timed_out: bool, rep: dict, wd: sp.Workdir, sizes: tuple[int, int],
            limits: Limits, truncated: bool) -> str:
    import errno

    if timed_out:
        return "timeout"
    if rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit"
    if rep["exc"] == "MemoryError":
        return "memory_limit"
    if wd.full():
        return "disk_limit"
    if max(sizes) >= limits.file_bytes or rep["errno"] == errno.EFBIG:
        return "output_limit"
    if rep["guard"] or rep["exc"] == "PermissionError" or rep["errno"] == errno.EROFS:
        return "blocked"
    if rc != 0:
        return "error"
    return "output_limit" if truncated else "ok"


def _execute(code: str, limits: Limits, wd: sp.Workdir, guard: bool, sup: dict) -> ExecResult:
    cap = Path(tempfile.mkdtemp(prefix="sparse-rl-cap-"))
    r_fd = w_fd = -1
    try:
        src = cap / "main.py"
        src.write_text(code)
        os.chmod(cap, 0o755)
        os.chmod(src, 0o644)
        wd.chown_all()
        r_fd, w_fd = os.pipe()
        # RLIMIT_NPROC counts every task of the uid: a sandbox uid runs nothing yet, our own does.
        nproc = limits.nproc + (0 if wd.uid is not None else sp.count_tasks(os.getuid()))
        with open(cap / "stdout", "wb") as out, open(cap / "stderr", "wb") as err:
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(wd.path)}
            argv = [sup["python"], "-I", "-X", "utf8", "-c", BOOT, str(src), "1" if guard else "0",
                    "0" if sup["nproc_limit"] else "1", str(w_fd), sup["seccomp_filter"]]
            t0 = time.monotonic()
            proc = subprocess.Popen(argv, cwd=wd.path, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True, pass_fds=(w_fd,),
                                    preexec_fn=sp.preexec(limits, wd.uid, sup["namespaces"],
                                                          wd.path if sup["readonly_mounts"] else None, nproc))
            os.close(w_fd)
            w_fd = -1
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc)  # also kills stragglers left behind by a normal exit
            wall = time.monotonic() - t0
        rep = _read_report(r_fd)
        r_fd = -1
        sizes = ((cap / "stdout").stat().st_size, (cap / "stderr").stat().st_size)
        with open(cap / "stdout", "rb") as fh:
            stdout = fh.read(limits.output_bytes).decode("utf-8", "replace")
        with open(cap / "stderr", "rb") as fh:
            fh.seek(max(0, sizes[1] - limits.output_bytes))
            stderr = fh.read().decode("utf-8", "replace")
        truncated = sizes[0] > limits.output_bytes
        status = _status(proc.returncode, timed_out, rep, wd, sizes, limits, truncated)
        enforced = {k: bool(sup.get(k)) for k in ENFORCED_KEYS}
        enforced.update(seccomp=rep["seccomp"], disk_limit=wd.disk_limited, guard=guard)
        return ExecResult(status, proc.returncode, stdout, stderr, round(wall, 3), truncated, enforced)
    finally:
        for fd in (r_fd, w_fd):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(cap, ignore_errors=True)


def run_python(code: str, limits: Limits | None = None, workdir: sp.Workdir | None = None,
               guard: bool = True) -> ExecResult:
    """Run `code` as `main.py` in `workdir` (a fresh private one, removed afterwards, if None).

    Pass a `Workdir` from `open_workdir()` to keep files between calls (a stateful tool); its
    disk and file-count caps are those of the limits it was opened with.
    """
    limits = limits or Limits()
    sup = platform_support()
    if not sup["nproc_limit"]:
        guard = True  # nothing else would stop a fork bomb here: never run without the guard
    own = workdir is None
    wd = open_workdir(limits, sup) if own else workdir
    try:
        return _execute(code, limits, wd, guard, sup)
    finally:
        if own:
            wd.close()
