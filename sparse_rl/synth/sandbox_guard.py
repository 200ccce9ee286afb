"""The program the sandboxed interpreter runs (`python -I -c BOOT main.py ...`), standard library only.

In order: install the seccomp filter (`seccomp.INSTALL`; the kernel layer that refuses exec and
unix sockets), then optionally the audit-hook guard (`GUARD`; a second, in-process layer), then
run main.py. An uncaught exception's type and errno are written to a pipe the parent reads, so
the parent classifies a run by what the interpreter raised and by its exit status, never by
what the program printed.

argv: main.py path, guard "1"/"0", block fork "1"/"0", report pipe fd, seccomp filter as hex ("" = none).
"""

from sparse_rl.synth.seccomp import INSTALL as _SECCOMP

GUARD = r'''
def _install(src_path, block_fork):
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

    with open(src_path) as fh:
        src = fh.read()
    sys.addaudithook(hook)
    return src

'''

_MAIN = r'''
import sys as _sys
_a = _sys.argv[1:]


def _report(s, _w=__import__("posix").write, _fd=int(_a[3])):
    try:
        _w(_fd, (s + "\n").encode())
    except OSError:
        pass


if _a[4]:
    try:
        _seccomp(_a[4])
        _report("seccomp")
    except Exception as _e:
        _report("seccomp-failed " + type(_e).__name__)
del _seccomp
if _a[1] == "1":
    _src = _install(_a[0], _a[2] == "1")
else:
    with open(_a[0]) as _fh:
        _src = _fh.read()
del _install
_sys.argv = ["main.py"]
_g = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(_src, "main.py", "exec"), _g)
except SystemExit:
    raise
except BaseException as _e:
    _report("exc %s %s %d" % (type(_e).__name__, getattr(_e, "errno", None), str(_e).startswith("sandbox:")))
    raise
'''

BOOT = _SECCOMP + GUARD + _MAIN
