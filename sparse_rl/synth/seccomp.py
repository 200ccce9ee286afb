"""The seccomp-BPF filter the sandboxed interpreter installs on itself before the user code runs.

Once installed (with no_new_privs) the kernel applies it to the process and everything it forks,
whatever the code does in Python or through raw syscalls, and it cannot be removed. It refuses:

  - execve/execveat (EPERM): no program but the interpreter already running, so neither `/bin/sh`
    nor an unhooked second interpreter can start;
  - socket(AF_UNIX) (EPERM): pathname unix sockets are outside the network namespace's reach, so a
    world-writable host socket would otherwise be reachable;
  - clone with namespace flags (EPERM) and clone3 (ENOSYS, whose flags sit in memory BPF cannot
    read; the C library then falls back to clone): no new user/mount/pid namespace;
  - mount and the new mount API, unshare, setns, pivot_root, chroot, ptrace, process_vm_*, bpf,
    perf_event_open, userfaultfd, keyctl/add_key/request_key, kexec_load (EPERM);
  - any other architecture's syscall convention (e.g. 32-bit int 0x80 on x86-64): the process is
    killed, since its syscall numbers differ; on x86-64 the x32 range is refused.

This is the same deny-list approach as Docker's default profile, much smaller; only the two
architectures our machines use are known (`build_filter` returns None elsewhere, and the sandbox
reports `seccomp: False`).
"""

from __future__ import annotations

import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# name -> (x86_64, aarch64) syscall numbers (asm/unistd_64.h, asm-generic/unistd.h)
_NR = {
    "execve": (59, 221), "execveat": (322, 281), "socket": (41, 198), "clone": (56, 220), "clone3": (435, 435),
    "ptrace": (101, 117), "mount": (165, 40), "umount2": (166, 39), "unshare": (272, 97), "setns": (308, 268),
    "pivot_root": (155, 41), "chroot": (161, 51), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "bpf": (321, 280), "userfaultfd": (323, 282), "keyctl": (250, 219),
    "add_key": (248, 217), "request_key": (249, 218), "perf_event_open": (298, 241),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kexec_load": (246, 104),
}
DENIED = ("execve", "execveat", "ptrace", "mount", "umount2", "unshare", "setns", "pivot_root", "chroot",
          "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "bpf",
          "userfaultfd", "keyctl", "add_key", "request_key", "perf_event_open", "process_vm_readv",
          "process_vm_writev", "kexec_load")
AF_UNIX = 1
CLONE_NS_FLAGS = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
X32_BIT = 0x40000000
EPERM, ENOSYS = 1, 38

_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16  # struct seccomp_data; arg0's low word (little-endian)


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter(machine: str | None = None) -> bytes | None:
    """The filter as packed `struct sock_filter` instructions, or None for an unknown architecture."""
    machine = machine or platform.machine()
    if machine not in AUDIT_ARCH:
        return None
    col = 0 if machine == "x86_64" else 1
    nr = {k: v[col] for k, v in _NR.items()}
    deny = _ins(_RET, _ERRNO | EPERM)
    prog = [_ins(_LD_W_ABS, _OFF_ARCH), _ins(_JEQ, AUDIT_ARCH[machine], 1, 0), _ins(_RET, _KILL_PROCESS),
            _ins(_LD_W_ABS, _OFF_NR)]
    if machine == "x86_64":
        prog += [_ins(_JGE, X32_BIT, 0, 1), deny]
    for name in DENIED:
        prog += [_ins(_JEQ, nr[name], 0, 1), deny]
    prog += [_ins(_JEQ, nr["clone3"], 0, 1), _ins(_RET, _ERRNO | ENOSYS)]
    # The two argument checks come last: each loads an argument, so each ends in its own returns.
    prog += [_ins(_JEQ, nr["socket"], 0, 4), _ins(_LD_W_ABS, _OFF_ARG0), _ins(_JEQ, AF_UNIX, 0, 1), deny,
             _ins(_RET, _ALLOW)]
    prog += [_ins(_JEQ, nr["clone"], 0, 4), _ins(_LD_W_ABS, _OFF_ARG0), _ins(_JSET, CLONE_NS_FLAGS, 0, 1), deny,
             _ins(_RET, _ALLOW)]
    prog.append(_ins(_RET, _ALLOW))
    return b"".join(prog)


# Run inside the sandboxed interpreter (standard library only): installs the hex-encoded filter.
INSTALL = r'''
def _seccomp(hexprog):
    import ctypes, sys
    prog = bytes.fromhex(hexprog)
    buf = ctypes.create_string_buffer(prog, len(prog))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fp = Fprog(len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    u = ctypes.c_ulong
    # PR_SET_NO_NEW_PRIVS = 38, PR_SET_SECCOMP = 22, SECCOMP_MODE_FILTER = 2
    if libc.prctl(38, u(1), u(0), u(0), u(0)) != 0 or \
            libc.prctl(22, u(2), u(ctypes.addressof(fp)), u(0), u(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl")
    for m in [m for m in sys.modules if m == "_ctypes" or m == "ctypes" or m.startswith("ctypes.")]:
        del sys.modules[m]  # so a later `import ctypes` raises the audit event the guard refuses
'''
