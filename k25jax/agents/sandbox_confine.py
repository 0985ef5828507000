"""Kernel confinement of a sandbox worker: namespaces, Landlock for files, seccomp for system calls.

The worker (`sandbox_worker.py`) calls `isolate` (as root, or in a user namespace) and then
`confine` once, after its start-up and before any model code runs. Every layer is
irreversible for the process and holds even when model code defeats everything written in
Python (the audit hook can be patched from inside the process; these cannot). Standard
library only (ctypes), so the worker can load it by path.

* namespaces (`isolate`; as root, else in a new user namespace where the kernel allows
  unprivileged ones): a private IPC namespace (System V objects and POSIX queues die with
  the worker) and a private mount namespace whose root is a read-only tmpfs holding only
  the working directory (its own tmpfs of `disk_bytes` and `max_files` inodes: the
  session's disk quota, gone with the worker) and read-only binds of the NumPy and
  standard-library directories. The host's file system is not there: stat, inotify,
  utime or xattr calls on host paths find nothing. Where no namespace can be made
  (no privilege, user namespaces disabled) the result says so, and stat of host paths
  stays possible: seccomp cannot read path arguments and Landlock does not mediate stat.
* Landlock (Linux >= 5.13, any user): the process may read and write beneath `work_dir`
  and only read beneath `read_roots`; every other open, create, remove or rename is
  refused with EACCES. From ABI 4 TCP bind/connect are refused too, from ABI 6 signals
  and abstract Unix sockets outside the sandbox.
* seccomp (x86_64, aarch64): the system calls in `DENIED` fail with EPERM: sockets,
  fork/clone/exec, signals and tracing of other processes (kill, ptrace,
  process_vm_*, pidfd_*), scheduling or memory of other processes (setpriority,
  sched_set*, move_pages, ...), rlimit changes, io_uring, namespaces, mount and the new
  mount API, pivot_root, bpf, keys, System V IPC, POSIX message queues, memfd, and the
  metadata calls Landlock does not cover (inotify/fanotify, utime*, chmod*, chown*,
  xattrs, file handles). A call from a foreign architecture ABI kills the process.

Where a layer is missing (an older kernel, another architecture) `isolate`/`confine` say so
in their result instead of failing, and the sandbox's other layers remain.
"""
import ctypes
import errno
import os
import struct

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
        # System V IPC and POSIX message queues (not namespaced without CLONE_NEWIPC: they
        # would outlive the session and carry data to the next one), memfd
        "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "semget": 64, "semop": 65,
        "semctl": 66, "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70,
        "msgctl": 71, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242,
        "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245, "memfd_create": 319,
        "memfd_secret": 447,
        # metadata of files (Landlock does not cover these): watches, times, modes, owners, xattrs
        "inotify_init": 253, "inotify_init1": 294, "inotify_add_watch": 254,
        "fanotify_init": 300, "fanotify_mark": 301, "utime": 132, "utimes": 235,
        "futimesat": 261, "utimensat": 280, "chmod": 90, "fchmod": 91, "fchmodat": 268,
        "fchmodat2": 452, "chown": 92, "fchown": 93, "lchown": 94, "fchownat": 260,
        "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197,
        "lremovexattr": 198, "fremovexattr": 199, "getxattr": 191, "lgetxattr": 192,
        "fgetxattr": 193, "listxattr": 194, "llistxattr": 195, "flistxattr": 196,
        "setxattrat": 463, "getxattrat": 464, "listxattrat": 465, "removexattrat": 466,
        "name_to_handle_at": 303, "open_by_handle_at": 304,
        # the mount API beyond mount(2)
        "pivot_root": 155, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "open_tree_attr": 467,
        # other processes of the same user (other sessions' workers run as `nobody` too)
        "setpriority": 141, "sched_setparam": 142, "sched_setscheduler": 144,
        "sched_setaffinity": 203, "sched_setattr": 314, "ioprio_set": 251,
        "migrate_pages": 256, "move_pages": 279, "process_madvise": 440, "kcmp": 312,
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
        "shmget": 194, "shmat": 196, "shmctl": 195, "shmdt": 197, "semget": 190, "semop": 193,
        "semctl": 191, "semtimedop": 192, "msgget": 186, "msgsnd": 189, "msgrcv": 188,
        "msgctl": 187, "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182,
        "mq_timedreceive": 183, "mq_notify": 184, "mq_getsetattr": 185, "memfd_create": 279,
        "memfd_secret": 447,
        "inotify_init1": 26, "inotify_add_watch": 27, "fanotify_init": 262,
        "fanotify_mark": 263, "utimensat": 88, "fchmod": 52, "fchmodat": 53,
        "fchmodat2": 452, "fchown": 55, "fchownat": 54, "setxattr": 5, "lsetxattr": 6,
        "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16,
        "getxattr": 8, "lgetxattr": 9, "fgetxattr": 10, "listxattr": 11, "llistxattr": 12,
        "flistxattr": 13, "setxattrat": 463, "getxattrat": 464, "listxattrat": 465,
        "removexattrat": 466, "name_to_handle_at": 264, "open_by_handle_at": 265,
        "pivot_root": 41, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "open_tree_attr": 467,
        "setpriority": 140, "sched_setparam": 118, "sched_setscheduler": 119,
        "sched_setaffinity": 122, "sched_setattr": 274, "ioprio_set": 30,
        "migrate_pages": 238, "move_pages": 239, "process_madvise": 440, "kcmp": 272,
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


# ----------------------------------------------------------------- namespaces
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1 << 10, 1 << 11, 1 << 12, 1 << 14, 1 << 18, 1 << 21
MNT_DETACH = 2
# statvfs flags of a mount that a read-only remount must keep (a user namespace locks them)
KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
              (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
ROOT_TMPFS = "size=1m,nr_inodes=4096,mode=0755"   # the new root: mount points only, read-only once built
LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _mount(source, target, fstype, flags: int, data: str | None = None) -> None:
  encode = lambda text: None if text is None else os.fsencode(text)
  _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
         f"mount({target!r})")


def _write(path: str, text: str) -> None:
  fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
  try:
    os.write(fd, text.encode())
  finally:
    os.close(fd)


def _unshare() -> bool:
  """New mount and IPC namespaces: directly as root (which needs CAP_SYS_ADMIN), else inside a new
  user namespace that maps only the current user and group to themselves. True when a user
  namespace was made. Raises OSError when the kernel allows neither."""
  namespaces = CLONE_NEWNS | CLONE_NEWIPC
  if os.geteuid() == 0:   # root then drops to `nobody`, which a user namespace would not map
    _check(_libc.unshare(namespaces), "unshare(CLONE_NEWNS | CLONE_NEWIPC)")
    return False
  uid, gid = os.geteuid(), os.getegid()
  _check(_libc.unshare(namespaces | CLONE_NEWUSER), "unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC)")
  _write("/proc/self/setgroups", "deny")
  _write("/proc/self/uid_map", f"{uid} {uid} 1")
  _write("/proc/self/gid_map", f"{gid} {gid} 1")
  return True


def _bind_read_only(source: str, target: str) -> None:
  os.makedirs(target, exist_ok=True)
  _mount(source, target, None, MS_BIND | MS_REC)
  kept = sum(ms for st, ms in KEPT_FLAGS if os.statvfs(source).f_flag & st)
  _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)


def isolate(root_dir: str, work_dir: str, read_roots, disk_bytes: int, max_files: int, owner) -> dict:
  """Moves the process into its own IPC and mount namespaces, the latter rooted at a tmpfs built
  on `root_dir` (an empty directory) that holds only `work_dir` (a fresh tmpfs of `disk_bytes`
  and `max_files` inodes owned by `owner` = (uid, gid), or by the current user in a user
  namespace) and read-only binds of `read_roots` (at their given and their real paths); the
  process ends in `work_dir`. Paths must be absolute; run it before dropping privileges, while
  single-threaded. Returns {"mount_namespace", "ipc_namespace", "user_namespace": bool,
  "disk_quota_mb": float or None, "isolation_error": str or None}. When no namespace can be
  made, or building the new root fails before the switch, the process keeps the host's view
  (and says so); a failure during the switch raises (the worker must not start)."""
  result = {"mount_namespace": False, "ipc_namespace": False, "user_namespace": False,
            "disk_quota_mb": None, "isolation_error": None}
  try:
    result["user_namespace"] = _unshare()
  except OSError as e:
    return {**result, "isolation_error": str(e)}
  result["ipc_namespace"] = True
  if result["user_namespace"]:
    owner = (os.geteuid(), os.getegid())
  try:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)   # nothing done here reaches the host's namespace
    _mount("k25jax_sandbox", root_dir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, ROOT_TMPFS)
    for root in dict.fromkeys(p for r in read_roots for p in (r, os.path.realpath(r))):
      if os.path.isdir(root):
        _bind_read_only(root, root_dir + root)
    target = root_dir + work_dir
    os.makedirs(target, exist_ok=True)
    _mount("k25jax_sandbox_work", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"size={disk_bytes},nr_inodes={max_files},mode=0700,uid={owner[0]},gid={owner[1]}")
  except OSError as e:
    os.chdir(work_dir)
    return {**result, "isolation_error": str(e)}
  os.chdir(root_dir)
  if _libc.syscall(SYSCALLS[os.uname().machine]["pivot_root"], b".", b".") == 0:
    _check(_libc.umount2(b".", MNT_DETACH), "umount2(old root)")   # the host's tree, stacked on ".", goes
  else:   # the host's root is no mount point (a chroot, an initramfs): its tree stays, out of reach
    _check(_libc.chroot(b"."), "chroot")
  os.chdir("/")
  _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
  os.chdir(work_dir)
  return {**result, "mount_namespace": True, "disk_quota_mb": disk_bytes / 2**20}


def drop_capabilities() -> None:
  """Clears the effective, permitted and inheritable capabilities (those a user namespace gave)."""
  header = struct.pack("Ii", LINUX_CAPABILITY_VERSION_3, 0)
  data = bytes(24)   # two struct __user_cap_data_struct of three zero u32 each
  _check(_libc.capset(header, data), "capset")
