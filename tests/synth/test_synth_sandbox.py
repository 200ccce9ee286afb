"""The Python sandbox stops an infinite loop, a memory hog, a fork bomb, an output flood and writes
outside its directory; each is reported and the host is left untouched.

Limits are tight so the whole file runs in a few seconds. The fork bomb is safe by construction:
RLIMIT_NPROC is set in the child before exec (and the child runs as an unprivileged uid when we are
root, since Linux never applies RLIMIT_NPROC to uid 0); where that cannot bind, the in-process
guard refuses os.fork; and the whole process group is SIGKILLed at the wall-clock limit.
"""

import os
import signal
import time

import pytest

from sparse_rl.synth.sandbox import Limits, platform_support, run_python

LIM = Limits(cpu_s=1, wall_s=2.0, memory_mb=256, nproc=16, output_bytes=4000, file_bytes=200_000)


def _pgid_members(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    out.append(int(d))
            except (ProcessLookupError, PermissionError):
                pass
    return out


def test_ok_and_private_cwd():
    r = run_python("import os\nprint(sorted(os.environ))\nopen('f.txt','w').write('x')\nprint(os.getcwd())", LIM)
    assert r.status == "ok" and r.returncode == 0
    env_keys = eval(r.stdout.splitlines()[0])
    assert set(env_keys) <= {"PATH", "LANG", "HOME", "LC_CTYPE"}
    cwd = r.stdout.splitlines()[1]
    assert "sparse-rl-sbx-" in cwd and not os.path.exists(cwd)  # private and removed afterwards


@pytest.mark.parametrize("guard", [True, False])
def test_infinite_loop_stopped(guard):
    t = time.monotonic()
    r = run_python("while True:\n    pass\n", LIM, guard=guard)
    assert r.status in ("cpu_limit", "timeout") and r.returncode < 0
    assert time.monotonic() - t < LIM.wall_s + 2


def test_sleeping_child_is_killed_at_wall_clock():
    r = run_python("import time\ntime.sleep(60)\n", Limits(wall_s=0.5))
    assert r.status == "timeout" and r.returncode == -signal.SIGKILL and r.wall_s < 2


@pytest.mark.parametrize("guard", [True, False])
def test_memory_hog_stopped(guard):
    r = run_python("x = bytearray(2 * 1024 ** 3)\nprint('allocated')", LIM, guard=guard)
    assert r.status == "memory_limit" and "allocated" not in r.stdout


@pytest.mark.parametrize("guard", [True, False])
def test_output_flood_capped(guard):
    r = run_python("while True:\n    print('y' * 1000)\n", LIM, guard=guard)
    assert r.status == "output_limit" and r.truncated
    assert len(r.stdout) == LIM.output_bytes


def test_fork_bomb_contained_and_nothing_survives():
    """Kernel limit alone where RLIMIT_NPROC binds (the guard off), the guard where it cannot; then
    the child's process group must be empty."""
    import subprocess

    import sparse_rl.synth.sandbox as sb

    seen = {}
    real_popen = subprocess.Popen

    class Spy(real_popen):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen["pgid"] = self.pid

    sb.subprocess.Popen = Spy
    try:
        r = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                       LIM, guard=not platform_support()["nproc_limit"])
    finally:
        sb.subprocess.Popen = real_popen
    assert r.status in ("timeout", "cpu_limit", "blocked")
    assert r.wall_s < LIM.wall_s + 12
    assert _pgid_members(seen["pgid"]) == []
    if r.enforced["nproc_limit"]:
        assert r.enforced["guard"] is False  # it was the kernel limit that held


def test_background_child_does_not_outlive_the_run():
    r = run_python("import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint(os.getpgid(0))", LIM)
    assert r.status == "ok"
    assert _pgid_members(int(r.stdout.strip())) == []


@pytest.fixture
def world_writable_dir():
    """A 0777 directory every uid can reach (pytest's tmp_path is inside a 0700 directory), so only
    the sandbox can stop a write into it."""
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="sparse-rl-victim-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("code", [
    "open({target!r}, 'w').write('pwned')",
    "import os\nos.symlink({tdir!r}, 'out')\nopen('out/victim.txt', 'w').write('pwned')",
    "open('../../../../../..' + {target!r}, 'w').write('pwned')",
    "import os\nos.rename({target!r}, 'stolen')",
    "import shutil\nshutil.rmtree({tdir!r})",
    "import subprocess\nsubprocess.run(['sh', '-c', 'echo pwned > {target}'])",
])
@pytest.mark.parametrize("layer", ["guard", "kernel"])
def test_write_outside_blocked(world_writable_dir, code, layer):
    """Both layers on their own: the in-process guard, and (guard off) the read-only mount namespace."""
    tmp_path = world_writable_dir
    if layer == "kernel" and not platform_support()["readonly_mounts"]:
        pytest.skip("this platform allows no private mount namespace; only the guard confines writes here")
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    victim.chmod(0o666)
    r = run_python(code.format(target=str(victim), tdir=str(tmp_path)), LIM, guard=layer == "guard")
    if layer == "guard":
        assert r.status == "blocked" and "PermissionError: sandbox:" in r.stderr, (r.status, r.stderr)
    else:
        assert r.status in ("blocked", "error") and ("Read-only file system" in r.stderr or "cross-device" in r.stderr), r.stderr
    assert victim.read_text() == "original" and sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]


@pytest.mark.parametrize("code", [
    # monkeypatching the path helpers does not fool the guard (it resolves with captured C functions)
    "import os, os.path\nos.path.realpath = lambda p: os.getcwd()\nos.lstat = None\nopen({target!r}, 'w').write('pwned')",
    # a directory fd outside would anchor dir_fd calls the open event cannot show
    "import os\nfd = os.open({tdir!r}, os.O_RDONLY)\nos.open('victim.txt', os.O_WRONLY | os.O_TRUNC, dir_fd=fd)",
    "import os\nos.makedirs('a/b/c')\nfd = os.open('.', os.O_RDONLY)\nos.chdir('a/b/c')\n"
    "os.open('../../../../' + {target!r}.rsplit('/', 1)[1], os.O_WRONLY | os.O_TRUNC, dir_fd=fd)",
    # a relative symlink that is fine where it is created, then moved so that it points out
    "import os\nos.makedirs('a/b')\nos.symlink('../../x', 'a/b/l')\nos.rename('a/b/l', 'l')",
    # a path-like object (CPython converts it once, before the audit event)
    "class P:\n    def __fspath__(self):\n        return {target!r}\nopen(P(), 'w').write('pwned')",
    # changing a file's mode through an fd opened for reading
    "import os\nfd = os.open({target!r}, os.O_RDONLY)\nos.chmod(fd, 0o777)",
    # foreign calls would bypass every audit event
    "import ctypes",
    # digging the hook out of the heap
    "import gc\n[f for f in gc.get_objects() if getattr(f, '__name__', '') == 'hook']",
    "import os\nos.chdir({tdir!r})\nopen('victim.txt', 'w').write('pwned')",
])
def test_guard_resists_bypasses(world_writable_dir, code):
    victim = world_writable_dir / "victim.txt"
    victim.write_text("original")
    victim.chmod(0o644)
    r = run_python(code.format(target=str(victim), tdir=str(world_writable_dir)), LIM)
    assert r.status == "blocked" and "PermissionError: sandbox:" in r.stderr, (r.status, r.stderr)
    assert victim.read_text() == "original" and oct(victim.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in world_writable_dir.iterdir()) == ["victim.txt"]


def test_guard_allows_ordinary_code():
    code = ("import os, json, pathlib, shutil, csv\nos.makedirs('a/b')\npathlib.Path('a/b/x.json').write_text(json.dumps([1]))\n"
            "shutil.copyfile('a/b/x.json', 'y.json')\nos.rename('y.json', 'z.json')\nos.symlink('z.json', 'l')\n"
            "print(open('l').read(), sorted(os.listdir('.')), len(open('/etc/hostname').read()) >= 0)\n"
            "shutil.rmtree('a')\nos.remove('l')")
    r = run_python(code, LIM)
    assert r.status == "ok", r.stderr
    assert r.stdout.strip() == "[1] ['a', 'l', 'z.json'] True"


def test_network_cut():
    code = "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('10.255.255.1', 80))\n"
    r = run_python(code, LIM)
    assert r.status == "blocked" and "network access is disabled" in r.stderr
    if platform_support()["network_namespace"]:  # the kernel layer alone, where the platform has it
        r = run_python(code, LIM, guard=False)
        assert r.status == "error" and ("unreachable" in r.stderr or "Errno 101" in r.stderr)
