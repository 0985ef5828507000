"""The sandbox worker: one process that runs model-written Python for one session.

`sandbox.Session` starts it as `python -I -B sandbox_worker.py CONFIG_JSON` in a fresh
working directory with a minimal environment and its own process group. It depends on
the standard library and NumPy only (it loads image_ops and sandbox_confine by path),
because `-I` keeps the project off sys.path. Start-up, in order:

1. keep the protocol pipes (stdin: requests, stdout: replies, one JSON object per line)
   on private descriptors and point descriptors 0 and 1 at /dev/null;
2. import every allowed module (later imports then never touch the disk) and load the
   task's images (.npy, no pickles) into the namespace;
3. isolate the process (`sandbox_confine.isolate`, as root or in a user namespace): its
   own IPC namespace, and a mount namespace whose root holds only the working directory
   (a tmpfs of `disk_mb`: the session's disk quota) and the NumPy and standard-library
   directories, read-only;
4. when started as root, drop to the `nobody` user (so the process limits below bind
   and file permissions protect the host); in a user namespace, drop its capabilities;
5. set the process limits: RLIMIT_AS = start-up footprint + memory_mb, RLIMIT_NPROC 0 (no
   fork, no thread), RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE 0, and RLIMIT_CPU = the
   session's CPU budget (SIGXCPU, then SIGKILL one second later);
6. confine the process in the kernel (`sandbox_confine.confine`: Landlock keeps file
   access to the working directory, seccomp refuses sockets, new processes, exec,
   reaching other processes, IPC and file-metadata calls);
7. install the audit hook (`AuditPolicy`), which refuses the same operations with clear
   errors (and imports off the allow-list) however the code reached them; point
   descriptor 2 (the host's start-up log) at /dev/null; then say
   {"ready": true, "confinement": ..., "uid": ...}.

Per request {"id": str, "code": str}: arm a CPU timer (ITIMER_PROF: SIGPROF kills the worker
after cpu_s of CPU), run the code IPython-style (the value of a final expression is returned
as its repr), with stdout and stderr captured up to output_bytes, and reply
{"id", "ok", "stdout", "value", "error", "blocked"}. The host keeps the process stopped
(SIGSTOP) between calls and measures its CPU time and memory itself.

Model code sees restricted builtins: `__import__` admits only `ALLOWED_MODULES`, and
input/breakpoint/help/exit/quit are gone. That is the first line only: Python objects lead
back to real builtins (`np.__builtins__`, `().__class__.__base__.__subclasses__()`), and
the audit hook, being Python, can be patched from inside the process (tests do it). So can
everything else in this process, the reply pipe included (a process's code can write to any
descriptor it holds): model code can write replies of its own, so the host trusts a reply no
further than the model's own output, validates each one and enforces every limit from
outside. The boundary is the kernel's: the namespaces, the process limits, the unprivileged
user, Landlock and seccomp.
"""
import ast
import builtins
import io
import json
import math
import os
import resource
import signal
import sys

FILENAME = "<sandbox>"
ALLOWED_MODULES = (
    "numpy", "image_ops", "math", "cmath", "itertools", "functools", "collections",
    "statistics", "re", "json", "random", "fractions", "decimal", "heapq", "bisect",
    "string", "operator", "time", "copy", "dataclasses", "enum", "typing", "warnings",
)
DENIED_SUBMODULES = ("numpy.f2py", "numpy.distutils", "numpy.ctypeslib", "numpy.testing")
PRELOADED = tuple(m for m in ALLOWED_MODULES if m != "image_ops") + (   # at start-up: later imports read no file
    "numpy.linalg", "numpy.fft", "numpy.random", "numpy.polynomial", "numpy.ma", "numpy.char",
    "numpy.strings", "numpy.rec", "numpy.lib.stride_tricks", "numpy.lib.format", "numpy.lib.npyio",
    "collections.abc", "linecache", "traceback",   # warnings.showwarning imports linecache
)
OPTIONAL_PRELOADED = ("gzip", "bz2", "lzma")   # numpy's file readers try them; a Python build may lack some
MAX_BLOCKED = 20   # refusals listed per call; the rest are counted
MAX_BLOCKED_CHARS = 300   # the longest description of one refusal
REMOVED_BUILTINS = ("input", "breakpoint", "help", "exit", "quit", "copyright", "credits", "license")

DENIED_EVENTS = frozenset({
    "os.system", "os.kill", "os.killpg", "os.putenv", "os.unsetenv", "os.chdir", "os.fchdir",
    "os.mkdir", "os.remove", "os.rmdir", "os.rename", "os.symlink", "os.link", "os.truncate",
    "os.utime", "os.chmod", "os.chown", "os.chflags", "os.lchflags", "os.setxattr",
    "os.removexattr", "os.getxattr", "os.listxattr", "os.mkfifo", "os.mknod", "os.startfile",
    "os.add_dll_directory", "code.__new__", "sys.addaudithook", "sys.settrace",
    "sys.setprofile", "builtins.input", "builtins.breakpoint", "pdb.Pdb", "glob.glob",
    "glob.glob/2", "_thread.start_new_thread",
})
DENIED_PREFIXES = (
    "socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "ctypes.",
    "mmap.", "resource.", "signal.", "pty.", "shutil.", "tempfile.", "gc.", "urllib.",
    "http.", "ftplib.", "smtplib.", "poplib.", "imaplib.", "nntplib.", "telnetlib.",
    "webbrowser.", "sqlite3.", "syslog.", "_winapi.", "msvcrt.", "winreg.",
)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def module_allowed(name: str) -> bool:
  """True for an allowed top-level module or any of its submodules except DENIED_SUBMODULES."""
  if any(name == d or name.startswith(d + ".") for d in DENIED_SUBMODULES):
    return False
  return name.split(".")[0] in ALLOWED_MODULES


class AuditPolicy:
  """The audit hook (sys.addaudithook): raises in the operation that triggered `event`.

  * "import" of a module that is not allowed (an import not served from sys.modules) → ImportError;
  * "open" of a descriptor, of a path outside `work_dir` for writing, or outside
    `work_dir` and `read_roots` for reading → PermissionError; likewise "os.listdir"/"os.scandir";
  * process creation, signals to other processes, sockets, ctypes, mmap, rlimit changes,
    file-system changes other than writing files in `work_dir`, tracing, gc introspection
    and code-object construction (DENIED_EVENTS, DENIED_PREFIXES) → PermissionError.
  Each refusal is also recorded (`blocked()`), so an attempt shows even when the code catches it.
  """

  def __init__(self, work_dir: str, read_roots):
    self.work_dir = os.path.realpath(work_dir)
    # given and real paths: after `isolate` both are plain directories of the new root
    self.read_roots = tuple(dict.fromkeys(p for r in read_roots for p in (r, os.path.realpath(r)))) + (self.work_dir,)
    self._blocked, self._unlisted = [], 0

  def refuse(self, what: str, error=PermissionError, hint: str = ""):
    """Records `what` and raises `error`("sandbox: <what> is not allowed<hint>")."""
    if len(what) > MAX_BLOCKED_CHARS:
      what = what[:MAX_BLOCKED_CHARS - 3] + "..."
    if len(self._blocked) < MAX_BLOCKED:
      self._blocked.append(what)
    else:
      self._unlisted += 1
    raise error(f"sandbox: {what} is not allowed{hint}")

  def blocked(self) -> list[str]:
    """The refusals since the last `clear()`: the first MAX_BLOCKED, then how many more."""
    return self._blocked + ([f"... and {self._unlisted} more"] if self._unlisted else [])

  def clear(self) -> None:
    self._blocked, self._unlisted = [], 0

  def _check_path(self, event: str, path, write: bool) -> None:
    if isinstance(path, int):
      self.refuse(f"{event} of file descriptor {path}")
    real = os.path.realpath(os.fsdecode(os.fspath(path)))
    roots = (self.work_dir,) if write else self.read_roots
    if not any(real == root or real.startswith(root + os.sep) for root in roots):
      purpose = "writing outside the working directory" if write else "reading outside the allowed directories"
      self.refuse(f"{event}({os.fsdecode(os.fspath(path))!r}) for {purpose}")

  def __call__(self, event: str, args) -> None:
    if event == "import":
      if not module_allowed(args[0]):
        self.refuse(f"import of {args[0]!r}", ImportError)
    elif event == "open":
      path, mode, flags = args
      write = bool(mode and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
      self._check_path("open", path, write)
    elif event in ("os.listdir", "os.scandir"):
      self._check_path(event, "." if args[0] is None else args[0], write=False)
    elif event in DENIED_EVENTS or event.startswith(DENIED_PREFIXES):
      self.refuse(event)


class CappedText(io.TextIOBase):
  """A text stream that keeps the first `limit` bytes (UTF-8) written to it and drops the rest."""

  def __init__(self, limit: int):
    super().__init__()
    self.limit, self.size, self.truncated, self._parts = limit, 0, False, []

  def writable(self) -> bool:
    return True

  def write(self, text) -> int:
    if not isinstance(text, str):
      raise TypeError(f"write() argument must be str, not {type(text).__name__}")
    data = text.encode("utf-8", "replace")
    room = self.limit - self.size
    if len(data) > room:
      data, self.truncated = data[:room], True
    self._parts.append(data)
    self.size += len(data)
    return len(text)

  def getvalue(self) -> str:
    return b"".join(self._parts).decode("utf-8", "ignore")


def _cap(text: str, limit: int) -> tuple[str, bool]:
  data = text.encode("utf-8", "replace")
  return (text, False) if len(data) <= limit else (data[:limit].decode("utf-8", "ignore"), True)


def restricted_builtins(policy: AuditPolicy) -> dict:
  """The builtins model code sees: no interactive helpers, `__import__` limited to ALLOWED_MODULES
  (a refusal goes through `policy`, so it is recorded)."""
  real_import = builtins.__import__

  def sandbox_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level:
      raise ImportError("relative imports are not allowed in the sandbox")
    for module in [name] + [f"{name}.{item}" for item in (fromlist or ()) if item != "*"]:
      if not module_allowed(module):
        policy.refuse(f"import of {module!r}", ImportError, f"; allowed modules: {', '.join(ALLOWED_MODULES)}")
    return real_import(name, globals, locals, fromlist, level)

  table = {k: v for k, v in vars(builtins).items() if k not in REMOVED_BUILTINS}
  table["__import__"] = sandbox_import
  return table


def _error_line(error: BaseException):
  if isinstance(error, SyntaxError) and error.filename == FILENAME:
    return error.lineno
  line, tb = None, error.__traceback__
  while tb is not None:
    if tb.tb_frame.f_code.co_filename == FILENAME:
      line = tb.tb_lineno
    tb = tb.tb_next
  return line


def describe_error(error: BaseException, memory_mb: int) -> str:
  """'Type: message (line N)'; a MemoryError is reported as the memory limit."""
  kind = "MemoryError" if isinstance(error, MemoryError) else type(error).__name__
  text = error.msg if isinstance(error, SyntaxError) else str(error)
  message = f"{kind}: {text}" if text else kind
  line = _error_line(error)
  if line is not None:
    message += f" (line {line})"
  if isinstance(error, MemoryError):
    message = f"memory limit of {memory_mb} MB exceeded: {message}"
  return message


def _cpu_time() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def run_code(code: str, namespace: dict, sandbox_builtins: dict, limits: dict, policy: AuditPolicy) -> dict:
  """Runs one request IPython-style and returns the reply (see the module docstring).

  `sandbox_builtins` is put back first: exec would insert the real builtins into a
  namespace whose `__builtins__` an earlier call deleted."""
  out = CappedText(limits["output_bytes"])
  value, error = None, None
  policy.clear()
  namespace["__builtins__"] = sandbox_builtins
  saved = sys.stdout, sys.stderr
  sys.stdout = sys.stderr = out
  signal.setitimer(signal.ITIMER_PROF, limits["cpu_s"])
  try:
    tree = ast.parse(code, FILENAME, "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, FILENAME, "exec"), namespace)
    if last is not None:
      result = eval(compile(ast.Expression(last.value), FILENAME, "eval"), namespace)
      if result is not None:
        namespace["_"] = result
        value = repr(result)
  except BaseException as e:   # the model's code may raise anything, SystemExit included
    error = describe_error(e, limits["memory_mb"])
  finally:
    signal.setitimer(signal.ITIMER_PROF, 0)
    sys.stdout, sys.stderr = saved
  errors = [] if error is None else [_cap(error, limits["output_bytes"])[0]]
  if value is not None:
    value, value_cut = _cap(value, limits["output_bytes"])
    if value_cut:
      errors.append(f"value truncated at {limits['output_bytes']} bytes")
  if out.truncated:
    errors.append(f"output truncated at {limits['output_bytes']} bytes")
  return {"ok": not errors, "stdout": out.getvalue(), "value": value,
          "error": "; ".join(errors) or None, "blocked": policy.blocked()}


def _load_module(name: str, path: str):
  """Imports the file `path` as module `name` (the project is not on sys.path under -I)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def build_namespace(config: dict, policy: AuditPolicy) -> dict:
  """np, image_ops and its functions, and the task's images, under restricted builtins."""
  import importlib
  for name in PRELOADED:
    importlib.import_module(name)
  for name in OPTIONAL_PRELOADED:
    try:
      importlib.import_module(name)
    except ImportError:
      pass
  import numpy as np
  image_ops = _load_module("image_ops", config["image_ops_path"])
  namespace = {"__name__": "__sandbox__", "__builtins__": restricted_builtins(policy), "np": np,
               "image_ops": image_ops}
  namespace.update({name: getattr(image_ops, name) for name in image_ops.__all__})
  for name in config["image_names"]:
    namespace[name] = np.load(os.path.join(config["image_dir"], name + ".npy"), allow_pickle=False)
  return namespace


def _virtual_memory_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def drop_privileges(uid: int, gid: int) -> None:
  os.setgroups([])
  os.setgid(gid)
  os.setuid(uid)


def measure_baseline() -> dict:
  """What the limits of step 5 add to, read from /proc (which step 3 hides): CPU time, address
  space and open descriptors after start-up."""
  return {"cpu_s": _cpu_time(), "address_space": _virtual_memory_bytes(),
          "open_files": len(os.listdir("/proc/self/fd"))}


def set_limits(limits: dict, baseline: dict) -> None:
  """The kernel-enforced limits of step 5 (soft = hard, so the code cannot raise them)."""
  session_cpu = math.ceil(baseline["cpu_s"] + limits["session_cpu_s"])
  address_space = baseline["address_space"] + limits["memory_mb"] * 2**20
  open_files = baseline["open_files"] + limits["open_files"]
  for which, value in ((resource.RLIMIT_AS, address_space), (resource.RLIMIT_NPROC, 0),
                       (resource.RLIMIT_FSIZE, limits["file_mb"] * 2**20),
                       (resource.RLIMIT_NOFILE, open_files), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(which, (value, value))
  resource.setrlimit(resource.RLIMIT_CPU, (session_cpu, session_cpu + 1))


def _send(stream, message: dict) -> None:
  stream.write(json.dumps(message).encode() + b"\n")
  stream.flush()


def main() -> None:
  config = json.loads(sys.argv[1])
  requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
  null = os.open(os.devnull, os.O_RDWR)
  os.dup2(null, 0)
  os.dup2(null, 1)
  sys.dont_write_bytecode = True
  work_dir = os.getcwd()
  policy = AuditPolicy(work_dir, config["read_roots"])
  namespace = build_namespace(config, policy)
  sandbox_builtins = namespace["__builtins__"]
  confine = _load_module("sandbox_confine", os.path.join(os.path.dirname(__file__), "sandbox_confine.py"))
  limits, baseline = config["limits"], measure_baseline()
  if config["isolate"]:
    isolation = confine.isolate(config["root_dir"], work_dir, config["read_roots"], limits["disk_mb"] * 2**20,
                                config["max_files"], (config["uid"], config["gid"]))
  else:
    isolation = {"mount_namespace": False, "ipc_namespace": False, "user_namespace": False,
                 "disk_quota_mb": None, "isolation_error": "not asked for"}
  if isolation["user_namespace"]:
    confine.drop_capabilities()
  elif config["uid"] is not None:
    drop_privileges(config["uid"], config["gid"])
  set_limits(limits, baseline)
  confinement = confine.confine(os.curdir, config["read_roots"])   # the cwd: its parent is not searchable
  sys.addaudithook(policy)
  os.dup2(null, 2)   # was the host's start-up log: model code must not write to a host file
  os.close(null)
  _send(replies, {"ready": True, "confinement": {**confinement, **isolation}, "uid": os.getuid()})
  while line := requests.readline():   # the host writes {"id", "code"}; anything else ends the worker
    request = json.loads(line)
    reply = run_code(request["code"], namespace, sandbox_builtins, limits, policy)
    _send(replies, {"id": request["id"], **reply})
  os._exit(0)   # skip interpreter finalisation: the audit hook stays strict to the end


if __name__ == "__main__":
  main()
