"""Kernel confinement of a sandbox worker: Landlock for files, seccomp for system calls.

The worker (`sandbox_worker.py`) calls `confine` once, after its start-up and before any
model code runs. Both layers are irreversible for the process and hold even when model
code defeats everything written in Python (the audit hook can be patched from inside the
process; these cannot). Standard library only (ctypes), so the worker can load it by path.

* Landlock (Linux >= 5.13, any user): the process may read and write beneath `work_dir`
  and only read beneath `read_roots`; every other open, create, remove or rename is
  refused with EACCES. From ABI 4 TCP bind/connect are refused too, from ABI 6 signals
  and abstract Unix sockets outside the sandbox.
* seccomp (x86_64, aarch64): the system calls in `DENIED` fail with EPERM: sockets,
  fork/clone/exec, signals and tracing of other processes (kill, ptrace,
  process_vm_*, pidfd_*), rlimit changes, io_uring, namespaces, mount, bpf, keys. A call
  from a foreign architecture ABI kills the process.

Where a layer is missing (an older kernel, another architecture) `confine` says so in its
result instead of failing, and the sandbox's other layers remain.
"""
import ctypes
import errno
import os

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1

# Landlock file-system rights (bit i of handled_access_fs) and the ABI that introduced them.
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK, FS_MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

# seccomp: (audit arch, {name: number}) per machine; names not in a table do not exist there.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {
    "x86_64": {
        "socket": 41, "socketpair": 53, "connect": 42, "bind": 49, "listen": 50, "accept": 43,
        "accept4": 288, "clone": 56, "clone3": 435, "fork": 57, "vfork": 58, "execve": 59,
        "execveat": 322, "kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129,
        "rt_tgsigqueueinfo": 297, "ptrace": 101, "process_vm_readv": 310,
        "process_vm_writev": 311, "pidfd_open": 434, "pidfd_send_signal": 424,
        "pidfd_getfd": 438, "setrlimit": 160, "prlimit64": 302, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "unshare": 272, "setns": 308,
        "mount": 165, "umount2": 166, "chroot": 161, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249,
        "personality": 135,
    },
    "aarch64": {
        "socket": 198, "socketpair": 199, "connect": 203, "bind": 200, "listen": 201,
        "accept": 202, "accept4": 242, "clone": 220, "clone3": 435, "execve": 221,
        "execveat": 281, "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138,
        "rt_tgsigqueueinfo": 240, "ptrace": 117, "process_vm_readv": 270,
        "process_vm_writev": 271, "pidfd_open": 434, "pidfd_send_signal": 424,
        "pidfd_getfd": 438, "setrlimit": 164, "prlimit64": 261, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "unshare": 97, "setns": 268,
        "mount": 40, "umount2": 39, "chroot": 51, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "keyctl": 219, "add_key": 217, "request_key": 218,
        "personality": 92,
    },
}
DENIED = tuple(SYSCALLS["x86_64"])
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
SECCOMP_DATA_NR, SECCOMP_DATA_ARCH = 0, 4   # offsets in struct seccomp_data


class _RulesetAttr(ctypes.Structure):
  _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
              ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
  _pack_ = 1
  _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFilter(ctypes.Structure):
  _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> int:
  if result < 0:
    code = ctypes.get_errno()
    raise OSError(code, f"{what}: {os.strerror(code)}")
  return result


def landlock_abi() -> int:
  """The kernel's Landlock ABI version, 0 when Landlock is missing or disabled."""
  version = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                          ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
  return max(version, 0)


def _fs_rights(abi: int) -> int:
  rights = (1 << 13) - 1   # ABI 1: EXECUTE .. MAKE_SYM
  if abi >= 2:
    rights |= FS_REFER
  if abi >= 3:
    rights |= FS_TRUNCATE
  if abi >= 5:
    rights |= FS_IOCTL_DEV
  return rights


def restrict_files(work_dir: str, read_roots, abi: int) -> list[str]:
  """Landlock: read+write beneath work_dir, read beneath read_roots, nothing else (and no TCP,
  no outside signals where the ABI has them). Returns the read roots that could not be opened
  (they stay inaccessible). Needs no_new_privs set."""
  handled = _fs_rights(abi)
  attr = _RulesetAttr(handled_access_fs=handled,
                      handled_access_net=(NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 else 0,
                      scoped=(SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0)
  size = 8 if abi < 4 else 16 if abi < 6 else 24
  ruleset = _check(_libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                                 ctypes.c_uint32(0)), "landlock_create_ruleset")
  read = FS_READ_FILE | FS_READ_DIR
  write = read | FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_DIR | FS_MAKE_REG | FS_MAKE_SYM
  write |= handled & (FS_REFER | FS_TRUNCATE)
  skipped = []
  try:
    for path, access in [(work_dir, write)] + [(root, read) for root in read_roots]:
      try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
      except OSError:
        if path == work_dir:
          raise
        skipped.append(path)
        continue
      try:
        rule = _PathBeneathAttr(allowed_access=access, parent_fd=fd)
        _check(_libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH,
                             ctypes.byref(rule), ctypes.c_uint32(0)), f"landlock_add_rule({path!r})")
      finally:
        os.close(fd)
    _check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
  finally:
    os.close(ruleset)
  return skipped


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
  """The BPF filter as (code, jt, jf, k): wrong arch → kill; x32 call or a DENIED call → EPERM; else allow."""
  table = SYSCALLS[machine]
  denied = [table[name] for name in DENIED if name in table]
  program = [(BPF_LD_W_ABS, 0, 0, SECCOMP_DATA_ARCH),
             (BPF_JEQ_K, 1, 0, AUDIT_ARCH[machine]),
             (BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
             (BPF_LD_W_ABS, 0, 0, SECCOMP_DATA_NR)]
  tests = ([(BPF_JGE_K, X32_SYSCALL_BIT)] if machine == "x86_64" else []) + [(BPF_JEQ_K, nr) for nr in denied]
  for i, (code, k) in enumerate(tests):
    program.append((code, len(tests) - i, 0, k))   # jump over the remaining tests and ALLOW, to ERRNO
  program += [(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW), (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM)]
  return program


def filter_syscalls(machine: str) -> None:
  """Installs `seccomp_program(machine)`. Needs no_new_privs set."""
  program = seccomp_program(machine)
  filters = (_SockFilter * len(program))(*[_SockFilter(*op) for op in program])
  fprog = _SockFprog(len(program), filters)
  _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")


def confine(work_dir: str, read_roots) -> dict:
  """Applies both layers where the kernel has them; returns {"landlock_abi": int (0: none),
  "seccomp": bool, "unreadable_roots": [...]}. Sets no_new_privs (exec cannot gain privileges)."""
  _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
  abi = landlock_abi()
  skipped = restrict_files(work_dir, read_roots, abi) if abi else []
  machine = os.uname().machine
  if machine in SYSCALLS:
    filter_syscalls(machine)
  return {"landlock_abi": abi, "seccomp": machine in SYSCALLS, "unreadable_roots": skipped}
