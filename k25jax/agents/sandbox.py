"""The Python tool for zero-vision trajectories: model-written code in a sandboxed process.

    pool = SandboxPool(max_sessions=8, limits=Limits(cpu_s=2, wall_s=5, memory_mb=512))
    with pool.session(images={"img_1": arr}) as s:          # or: async with ... / await s.arun(code)
      r = s.run("print(count_objects(img_1, 'red'))")
      r.ok, r.stdout, r.value, r.error
    pool.close()

A session is one episode: a worker process (`sandbox_worker.py`) that keeps the code's
variables between calls, IPython-like (the value of a final expression comes back as its
repr). It is started on the first call, with NumPy as `np`, the image_ops functions (also
`import image_ops`) and the task's images (named arrays) in its namespace. Workers are never
shared between sessions: one episode's code cannot see or tamper with another's.

Each call runs under `Limits` (see there). What is enforced where:

* host side (here), trusting nothing the worker writes: the worker is stopped (SIGSTOP)
  except during a call, so nothing runs between calls; wall time and CPU time per call
  (measured in /proc, killing the worker: the worker's own CPU timer can be disarmed by
  its code); every reply is read with a deadline and a size cap and must be exactly one
  JSON object of the expected fields, types and sizes echoing the call's fresh id (its
  nesting is checked before parsing, numbers are refused), else the call ends in a
  "sandbox protocol error" observation and a new worker; CPU time and peak memory are
  measured here, not reported by the worker; every wait has a deadline (send, receive,
  stop, close: `close` kills a worker in mid-call and never hangs); a fresh temporary
  directory per worker, removed without recursion (any depth) and never raising; a
  minimal environment; the disk quota by a watcher when the kernel gave no tmpfs (below);
* worker side, by the kernel (the real boundary), see `sandbox_confine.py` and
  `Session.confinement` for what the running kernel provided: namespaces (as root, or in
  a user namespace where unprivileged ones are allowed): a private IPC namespace and a
  private mount namespace whose root holds only the working directory, a tmpfs of
  `disk_mb` (the session's disk quota, gone with the worker), and the NumPy and
  standard-library directories, read-only, so host paths are not there to stat, watch
  or touch; CPU time per call (ITIMER_PROF) and per session (RLIMIT_CPU), address space
  (RLIMIT_AS), no new processes or threads (RLIMIT_NPROC 0; the worker drops to `nobody`
  when started as root, where the limit would not bind), file size, open files, no core
  dumps; Landlock (files only beneath the working directory, read-only beneath the NumPy
  and standard-library directories) and seccomp (no sockets, fork, exec, signals or
  tracing of other processes, scheduling of other processes, rlimit changes, namespaces,
  mounts, System V IPC, POSIX message queues, memfd, inotify/fanotify, utime, chmod,
  chown, xattrs);
* worker side, by an audit hook, with clear errors: imports outside the allow-list,
  opening files outside those directories, sockets, process creation, signals, ctypes,
  mmap, rlimit changes, file-system changes. Python code can patch it; the kernel
  layers hold regardless (tested);
* model-visible builtins: `__import__` limited to the allow-list.

The reply pipe is reachable by the model's code (it runs in the process that writes
replies; a process can write to any descriptor it holds), so a reply's content is the
model's to choose, like its output; what it cannot do is crash or stall the host, run
outside its calls or escape a limit. Without a namespace (not root and no user
namespaces), stat of host paths stays possible (seccomp cannot read path arguments,
Landlock does not mediate stat) and the disk quota is the host's watcher: checked every
`DISK_CHECK_S` during a call and after it, the worker killed past it.

A call that breaks a limit returns ok=False with a clear error. When the worker had to die
(CPU or wall time, a crash, a protocol error, the disk quota without tmpfs), the error says
so and the next call starts a new worker with the variables lost, reported as `restarted=True`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import keyword
import os
import pwd
import re
import secrets
import select
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Mapping

import numpy as np

from k25jax.agents import image_ops, sandbox_worker

WORKER_PATH = sandbox_worker.__file__
MAX_CODE_BYTES = 1 << 20
STATE_LOST = "the worker was stopped; the next call starts a new one without the session's variables"
RESERVED_NAMES = frozenset({"np", "image_ops", "_", *image_ops.__all__})
USE_NAMESPACES = True   # isolate workers in IPC and mount namespaces where the kernel allows (tests turn it off)
MAX_FILES = 8192        # files and directories in a working directory
MAX_DEPTH = 64          # directory depth the host's disk watcher follows (deeper counts as over quota)
CPU_GRACE_S = 0.25      # the host kills a call at cpu_s + this (the worker's own timer fires at cpu_s)
DISK_CHECK_S = 0.2      # how often the host's disk watcher looks during a call (only without tmpfs)
STOP_WAIT_S = 5.0       # how long `stop` waits for a killed worker to be reaped (then a thread does)
CLOSE_WAIT_S = 10.0     # how long `close` waits for a call in flight to end after killing its worker
REPLY_FIELDS = frozenset({"id", "ok", "stdout", "value", "error", "blocked"})
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


class SandboxError(RuntimeError):
  """The sandbox itself failed (a worker that does not start): not the model's fault."""


class ProtocolError(ValueError):
  """The worker wrote something that is not a valid reply to the call."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-call and per-session limits of a sandbox worker.

  cpu_s: CPU seconds per call. wall_s: wall seconds per call. memory_mb: address space the
  code may add to the worker's start-up footprint (Python + NumPy, ~100 MB).
  output_bytes: stdout (and stderr) kept per call, and the longest repr of a value.
  file_mb: largest file the code may write. open_files: descriptors beyond start-up.
  session_cpu_s: CPU seconds over the whole session (a worker is killed past it).
  start_s: wall seconds a worker may take to start (Python + NumPy import; more under
  load). disk_mb: all files in the working directory together, at most MAX_FILES of them
  (a tmpfs: memory of the host, not counted in memory_mb).
  """

  cpu_s: float = 2.0
  wall_s: float = 5.0
  memory_mb: int = 512
  output_bytes: int = 8192
  file_mb: int = 16
  open_files: int = 16
  session_cpu_s: float = 60.0
  start_s: float = 60.0
  disk_mb: int = 64

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"Limits.{field.name} must be a positive number, got {value!r}")
    for name in ("memory_mb", "output_bytes", "file_mb", "open_files", "disk_mb"):
      if not isinstance(getattr(self, name), int):
        raise ValueError(f"Limits.{name} must be an int, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What one call returns.

  ok: the code ran to the end within every limit. stdout: what it printed (stderr
  included), at most output_bytes. value: repr of the final expression's value, or None.
  error: "Type: message (line N)", or the limit that stopped it; None when ok.
  restarted: this call ran in a new worker because the previous one was stopped (the
  session's variables are gone). blocked: operations the sandbox refused during the call,
  even ones the code caught. cpu_s, wall_s: time the call took (CPU measured by the host);
  peak_memory_mb: the worker's peak resident memory so far.
  """

  ok: bool
  stdout: str = ""
  value: str | None = None
  error: str | None = None
  restarted: bool = False
  blocked: tuple[str, ...] = ()
  cpu_s: float = 0.0
  wall_s: float = 0.0
  peak_memory_mb: float = 0.0


def _sandbox_user() -> tuple[int, int] | None:
  """(uid, gid) of `nobody` when running as root (the worker drops to it), else None."""
  if os.geteuid() != 0:
    return None
  try:
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid
  except KeyError:
    return 65534, 65534


def _worker_environment(work_dir: str) -> dict:
  return {"PATH": "/usr/bin:/bin", "HOME": work_dir, "LC_ALL": "C.UTF-8",
          "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _death(returncode: int | None, limits: Limits) -> str:
  if returncode is None:
    return "the worker stopped answering and could not be reaped"
  if returncode == -signal.SIGPROF:
    return f"cpu-time limit of {limits.cpu_s:g} s per call exceeded"
  if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
    return f"cpu-time limit of {limits.session_cpu_s:g} s per session exceeded (or the worker was killed)"
  if returncode < 0:
    return f"the worker died from signal {signal.Signals(-returncode).name}"
  return f"the worker exited with code {returncode}"


# ----------------------------------------------------------------- replies
def _refuse_number(text: str):
  raise ValueError(f"a number ({text[:20]}) where a reply has none")


def _text(reply: dict, name, limit: int, optional: bool = False) -> str | None:
  """reply[name] as a str of at most `limit` bytes (lone surrogates become '?')."""
  text = reply[name]
  what = f"reply field {name!r}" if isinstance(name, str) else f"item {name} of reply field 'blocked'"
  if text is None and optional:
    return None
  if not isinstance(text, str):
    raise ProtocolError(f"{what} is a {type(text).__name__}, not a str")
  data = text.encode("utf-8", "replace")
  if len(data) > limit:
    raise ProtocolError(f"{what} is longer than {limit} bytes")
  return data.decode("utf-8")


def reply_cap(limits: Limits) -> int:
  """The longest reply line a worker can legitimately write (JSON escapes a byte to 6 at most)."""
  strings = 3 * limits.output_bytes + 1024
  return 6 * strings + (sandbox_worker.MAX_BLOCKED + 1) * (12 * sandbox_worker.MAX_BLOCKED_CHARS + 8) + 4096


def parse_reply(line: bytes, request_id: str, limits: Limits) -> dict:
  """The worker's reply to request `request_id` as {"ok", "stdout", "value", "error", "blocked"},
  checked field by field; ProtocolError for anything else. The nesting is counted before
  parsing (a reply is one object holding one list), so the parser never recurses deeply."""
  skeleton = _JSON_STRING.sub(b'""', line)   # what is left of "{" and "[" is structure
  if skeleton.count(b"{") + skeleton.count(b"[") > 2:
    raise ProtocolError("a reply nested deeper than its format")
  try:
    reply = json.loads(line.decode("utf-8"), parse_int=_refuse_number, parse_float=_refuse_number,
                       parse_constant=_refuse_number)
  except (ValueError, RecursionError) as e:
    raise ProtocolError(f"a reply that is not valid JSON ({str(e)[:200]})") from None
  if not isinstance(reply, dict) or set(reply) != REPLY_FIELDS:
    raise ProtocolError(f"a reply without exactly the fields {sorted(REPLY_FIELDS)}")
  if reply["id"] != request_id:
    raise ProtocolError("a reply to another call")
  if not isinstance(reply["ok"], bool):
    raise ProtocolError("reply field 'ok' is not a bool")
  out = limits.output_bytes
  stdout, value = _text(reply, "stdout", out), _text(reply, "value", out, optional=True)
  error = _text(reply, "error", out + 256, optional=True)
  items = reply["blocked"]
  if not isinstance(items, list) or len(items) > sandbox_worker.MAX_BLOCKED + 1:
    raise ProtocolError(f"reply field 'blocked' is not a list of at most {sandbox_worker.MAX_BLOCKED + 1} items")
  blocked = tuple(_text(dict(enumerate(items)), i, 4 * sandbox_worker.MAX_BLOCKED_CHARS) for i in range(len(items)))
  if reply["ok"] != (error is None):
    raise ProtocolError("a reply whose 'ok' and 'error' disagree")
  return {"ok": reply["ok"], "stdout": stdout, "value": value, "error": error, "blocked": blocked}


# ----------------------------------------------------------------- the worker's directory
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def remove_tree(top: str) -> bool:
  """Deletes `top` and everything beneath it, at any depth, without recursion and holding one
  directory descriptor at a time (only for trees nothing else changes: a stopped worker's).
  True when `top` is gone; never raises."""
  try:
    try:
      if not stat.S_ISDIR(os.lstat(top).st_mode):
        os.unlink(top)
        return True
    except FileNotFoundError:
      return True
    below = []   # names from `top` down to the directory `fd` is open on
    fd = os.open(top, _DIRECTORY | os.O_NOFOLLOW)
    try:
      while True:
        child = None
        with os.scandir(fd) as entries:
          for entry in entries:
            if entry.is_dir(follow_symlinks=False):
              child = entry.name
              break
            os.unlink(entry.name, dir_fd=fd)
        if child is not None:
          try:
            os.rmdir(child, dir_fd=fd)   # empty already
          except OSError:
            inner = os.open(child, _DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
            below.append(child)
          continue
        if not below:
          break
        parent = os.open("..", _DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = parent
        os.rmdir(below.pop(), dir_fd=fd)
    finally:
      os.close(fd)
    os.rmdir(top)
    return True
  except Exception:   # cleanup reports, never raises
    return not os.path.lexists(top)


def disk_usage(top: str, max_files: int = MAX_FILES, max_depth: int = MAX_DEPTH) -> tuple[int, int, bool]:
  """(bytes allocated, entries, complete) beneath `top`, without recursion; stops early (complete
  False) past `max_files` entries or `max_depth` levels. Tolerates a tree changing meanwhile."""
  used, count, stack = 0, 0, []   # stack: (descriptor, its entries) down the current path
  try:
    fd = os.open(top, _DIRECTORY | os.O_NOFOLLOW)
    stack.append((fd, os.scandir(fd)))
    while stack:
      fd, entries = stack[-1]
      entry = next(entries, None)
      if entry is None:
        stack.pop()
        entries.close()
        os.close(fd)
        continue
      count += 1
      if count > max_files:
        return used, count, False
      try:
        info = entry.stat(follow_symlinks=False)
        used += info.st_blocks * 512
        if stat.S_ISDIR(info.st_mode):
          if len(stack) >= max_depth:
            return used, count, False
          inner = os.open(entry.name, _DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
          try:
            stack.append((inner, os.scandir(inner)))
          except OSError:
            os.close(inner)
            raise
      except OSError:
        continue
    return used, count, True
  except OSError:
    return used, count, False
  finally:
    for fd, entries in stack:
      entries.close()
      os.close(fd)


class _Failure(Exception):
  """A call that did not end in a valid reply: `message` says why; None when the worker died
  (its exit status then says why)."""

  def __init__(self, message: str | None = None):
    super().__init__(message)
    self.message = message


class _Worker:
  """One worker process, its directory (work/ is the code's cwd, root/ the mount point of its
  own root when it has a mount namespace) and the reply buffer."""

  def __init__(self, limits: Limits):
    self.limits = limits
    self.base = os.path.realpath(tempfile.mkdtemp(prefix="k25jax_sandbox_"))
    self.proc = None
    self.confinement = None
    self._pidfd = None
    self._buffer = b""
    self._signal_lock = threading.Lock()   # signals never reach a reaped (reusable) process id
    self._stop_lock = threading.Lock()
    self._watch_disk = False
    self._disk_checked = 0.0
    self._cpu_source = "schedstat"

  @property
  def work(self) -> str:
    return os.path.join(self.base, "work")

  # ----------------------------------------------------------------- start, signals, stop
  def start(self, images: Mapping[str, np.ndarray]) -> None:
    """Starts the worker and leaves it stopped, ready for a call; SandboxError when it does not start."""
    image_dir, root = os.path.join(self.base, "images"), os.path.join(self.base, "root")
    for directory in (self.work, image_dir, root):
      os.mkdir(directory, 0o700)
    for name, array in images.items():
      np.save(os.path.join(image_dir, name + ".npy"), array, allow_pickle=False)
    user = _sandbox_user()
    if user is not None:
      os.chown(self.work, *user)
    config = {
        "image_dir": image_dir, "image_names": sorted(images), "image_ops_path": image_ops.__file__,
        "read_roots": [os.path.realpath(os.path.dirname(np.__file__)), os.path.realpath(sysconfig.get_paths()["stdlib"])],
        "uid": user and user[0], "gid": user and user[1],
        "isolate": USE_NAMESPACES, "root_dir": root, "max_files": MAX_FILES,
        "limits": {k: v for k, v in dataclasses.asdict(self.limits).items() if k not in ("wall_s", "start_s")},
    }
    try:
      with open(os.path.join(self.base, "worker.log"), "wb") as log:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-B", WORKER_PATH, json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=self.work,
            env=_worker_environment(self.work), start_new_session=True, close_fds=True, bufsize=0)
    except OSError as e:
      raise SandboxError(f"the sandbox worker could not be started: {e}") from e
    try:
      self._pidfd = os.pidfd_open(self.proc.pid)
    except (AttributeError, OSError):
      self._pidfd = None   # a kernel before 5.3: signals go by process id (guarded by _signal_lock)
    os.set_blocking(self.proc.stdin.fileno(), False)
    try:
      line = self._read_line(time.monotonic() + self.limits.start_s, None, "start-up timed out")
      ready = json.loads(line)   # nothing of the model's has run yet
      if ready["ready"] is not True:
        raise ValueError(f"not a ready message: {line[:200]!r}")
      self.confinement = {"uid": ready["uid"], **ready["confinement"]}
      self.signal(signal.SIGSTOP)
      self._await_stop()
    except Exception:   # anything here means it did not start
      raise SandboxError(f"the sandbox worker did not start: {self._log_tail()}") from None
    self._watch_disk = not self.confinement.get("mount_namespace")
    self._cpu_source = "schedstat" if self.cpu_time() else "stat"

  def _log_tail(self, size: int = 2000) -> str:
    try:
      with open(os.path.join(self.base, "worker.log"), "rb") as log:
        return log.read()[-size:].decode("utf-8", "replace") or "(no output)"
    except OSError:
      return "(no log)"

  def signal(self, signum: int) -> None:
    """Sends `signum` to the worker unless it is already reaped; thread-safe, never raises."""
    with self._signal_lock:
      try:
        if self._pidfd is not None:
          signal.pidfd_send_signal(self._pidfd, signum)
        elif self.proc is not None and self.proc.returncode is None:
          os.kill(self.proc.pid, signum)
      except OSError:
        pass

  def _await_stop(self) -> None:
    """Returns once the worker is stopped (or dead): from then on none of its code runs until the
    next SIGCONT. _Failure when it does not stop within STOP_WAIT_S."""
    deadline, pause = time.monotonic() + STOP_WAIT_S, 1e-4
    while True:
      try:
        if os.waitid(os.P_PID, self.proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
          return
      except ChildProcessError:   # reaped already
        return
      if time.monotonic() > deadline:
        raise _Failure("the worker could not be stopped after its reply")
      time.sleep(pause)
      pause = min(2 * pause, 0.01)

  def stop(self) -> int | None:
    """Kills the worker, reaps it (waiting at most STOP_WAIT_S, then a thread takes over) and
    removes its directory; its return code (None if not reaped yet). Never raises."""
    with self._stop_lock:
      returncode, proc = None, self.proc
      if proc is not None:
        self.signal(signal.SIGKILL)
        try:
          returncode = proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
          threading.Thread(target=proc.wait, name="sandbox-reaper", daemon=True).start()
        with self._signal_lock:
          if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
          self.proc = None
        for stream in (proc.stdin, proc.stdout):
          try:
            stream.close()
          except OSError:
            pass
      try:
        remove_tree(self.base)   # never raises; a stand-in might
      except Exception:   # cleanup must free the slot whatever happens here
        pass
      return returncode

  # ----------------------------------------------------------------- measurements
  def cpu_time(self) -> float | None:
    """The worker's CPU seconds so far (from /proc: its own accounting is the model's to fake)."""
    try:
      if self._cpu_source == "schedstat":   # nanoseconds; the worker has one thread
        with open(f"/proc/{self.proc.pid}/schedstat", "rb") as f:
          return int(f.read().split()[0]) / 1e9
      with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
      return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
      return None

  def peak_memory_mb(self) -> float:
    """The worker's peak resident memory (VmHWM)."""
    try:
      with open(f"/proc/{self.proc.pid}/status", "rb") as f:
        for line in f:
          if line.startswith(b"VmHWM:"):
            return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError, AttributeError):
      pass
    return 0.0

  def _check_disk(self, force: bool = False) -> None:
    """The disk quota where the kernel gave no tmpfs: _Failure past disk_mb or MAX_FILES."""
    now = time.monotonic()
    if not self._watch_disk or (not force and now - self._disk_checked < DISK_CHECK_S):
      return
    self._disk_checked = now
    used, _, complete = disk_usage(self.work, MAX_FILES, MAX_DEPTH)
    if used > self.limits.disk_mb * 2**20 or not complete:
      raise _Failure(f"disk quota of {self.limits.disk_mb} MB ({MAX_FILES} files, {MAX_DEPTH} levels) exceeded")

  # ----------------------------------------------------------------- the pipes
  def _wait(self, fd: int, events: int, deadline: float, cpu_start: float | None, timeout: str) -> None:
    """Returns once `fd` is ready for `events` (or hung up); _Failure past the deadline, past the
    call's CPU time (`cpu_start` not None) or past the disk quota (watched meanwhile)."""
    poller = select.poll()
    poller.register(fd, events)
    while True:
      wait = deadline - time.monotonic()
      if wait <= 0:
        raise _Failure(timeout)
      if cpu_start is not None:
        used = self.cpu_time()
        if used is not None:
          left = self.limits.cpu_s + CPU_GRACE_S - (used - cpu_start)
          if left <= 0:
            raise _Failure(f"cpu-time limit of {self.limits.cpu_s:g} s per call exceeded")
          wait = min(wait, left)   # one thread: CPU time grows no faster than wall time
        self._check_disk()
        if self._watch_disk:
          wait = min(wait, DISK_CHECK_S)
      if poller.poll(max(wait, 0.001) * 1000):
        return

  def _write(self, data: bytes, deadline: float, cpu_start: float) -> None:
    fd, view = self.proc.stdin.fileno(), memoryview(data)
    while view:
      try:
        view = view[os.write(fd, view):]
      except BlockingIOError:
        pass
      except OSError:   # a broken pipe: the worker is gone, or closed its end
        raise self._ended("request") from None
      if view:
        self._wait(fd, select.POLLOUT, deadline, cpu_start, f"timeout after {self.limits.wall_s:g} s (wall-time limit)")

  def _read_line(self, deadline: float, cpu_start: float | None, timeout: str) -> bytes:
    fd, cap = self.proc.stdout.fileno(), reply_cap(self.limits)
    while b"\n" not in self._buffer:
      self._wait(fd, select.POLLIN, deadline, cpu_start, timeout)
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        raise self._ended("reply")
      self._buffer += chunk
      if len(self._buffer) > cap:
        raise _Failure(f"sandbox protocol error: a reply longer than {cap} bytes")
    line, _, self._buffer = self._buffer.partition(b"\n")
    return line

  def _expect_silence(self) -> None:
    """_Failure when the worker wrote anything outside a call (or died meanwhile)."""
    fd = self.proc.stdout.fileno()
    if self._buffer:
      raise _Failure("sandbox protocol error: the worker wrote more than one reply")
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if poller.poll(0):
      if os.read(fd, 1 << 16):
        raise _Failure("sandbox protocol error: the worker wrote outside a call")
      raise self._ended("reply")

  def _ended(self, pipe: str) -> _Failure:
    """The failure for a pipe the worker no longer holds: its death (exit status), or a protocol
    error when it lives on without it."""
    try:
      self.proc.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
      return _Failure(f"sandbox protocol error: the worker closed its {pipe} pipe")
    return _Failure()

  def call(self, code: str, deadline: float) -> dict:
    """Runs one call: the worker resumes, gets {"id", "code"}, must answer exactly once before the
    deadline and within the call's CPU time, and is stopped again. The reply checked
    (`parse_reply`) plus "cpu_s" and "peak_memory_mb" measured here; _Failure otherwise."""
    self._expect_silence()
    cpu_start = self.cpu_time() or 0.0
    request_id = secrets.token_hex(16)
    request = json.dumps({"id": request_id, "code": code}).encode() + b"\n"
    self.signal(signal.SIGCONT)
    self._write(request, deadline, cpu_start)
    line = self._read_line(deadline, cpu_start, f"timeout after {self.limits.wall_s:g} s (wall-time limit)")
    self.signal(signal.SIGSTOP)
    self._await_stop()
    cpu = (self.cpu_time() or cpu_start) - cpu_start
    if cpu > self.limits.cpu_s + CPU_GRACE_S:
      raise _Failure(f"cpu-time limit of {self.limits.cpu_s:g} s per call exceeded")
    try:
      reply = parse_reply(line, request_id, self.limits)
    except ProtocolError as e:
      raise _Failure(f"sandbox protocol error: {e}") from None
    self._expect_silence()   # exactly one reply
    self._check_disk(force=True)
    return {**reply, "cpu_s": cpu, "peak_memory_mb": self.peak_memory_mb()}


class Session:
  """One episode's Python tool: sync `run`, async `arun`, a (sync or async) context manager.

  Entering takes one of the pool's slots (waiting while all are taken); leaving stops the
  worker, removes its directory and frees the slot. Calls on one session run one at a time.
  """

  def __init__(self, pool: SandboxPool, images: Mapping[str, np.ndarray] | None):
    self.pool = pool
    self.images = _check_images(images or {})
    self._worker: _Worker | None = None
    self._state_lost = False
    self._lock = threading.Lock()        # one call (or close) at a time
    self._slot_lock = threading.Lock()   # the slot is freed exactly once
    self._holds_slot = False
    self._closing = False

  @property
  def pid(self) -> int | None:
    """The process id of the session's worker, None while none runs."""
    worker = self._worker
    return worker.proc.pid if worker is not None and worker.proc is not None else None

  @property
  def confinement(self) -> dict | None:
    """The kernel layers the worker runs under: {"uid", "landlock_abi" (0: none), "seccomp",
    "unreadable_roots", "mount_namespace", "ipc_namespace", "user_namespace", "disk_quota_mb"
    (None: the host's watcher), "isolation_error"}; None while no worker runs."""
    worker = self._worker
    return worker.confinement if worker is not None else None

  @property
  def work_dir(self) -> str | None:
    """The worker's working directory as the host reaches it (through /proc/PID/root when the
    worker has its own mount namespace; removed with the worker), None while none runs."""
    worker, pid = self._worker, self.pid
    if worker is None or pid is None:
      return None
    if (worker.confinement or {}).get("mount_namespace"):
      return f"/proc/{pid}/root{worker.work}"
    return worker.work

  # ----------------------------------------------------------------- life cycle
  def __enter__(self) -> Session:
    self._check_not_open()
    self.pool._take_slot(self)
    self._holds_slot, self._closing = True, False
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  async def __aenter__(self) -> Session:
    self._check_not_open()
    await self.pool._atake_slot(self)
    self._holds_slot, self._closing = True, False
    return self

  async def __aexit__(self, *exc) -> None:
    try:
      await asyncio.get_running_loop().run_in_executor(self.pool._executor, self.close)
    except RuntimeError:   # the pool's threads are shut down (the pool was closed): nothing left to wait for
      self.close()

  def _check_not_open(self) -> None:
    if self._holds_slot:
      raise RuntimeError("the session is already open")

  def close(self) -> None:
    """Stops the worker (no process or directory is left) and frees the pool slot. A call in
    flight ends at once (its worker is killed first); never raises, never waits past bounds."""
    self._closing = True
    worker = self._worker
    if worker is not None:
      worker.signal(signal.SIGKILL)
    locked = self._lock.acquire(timeout=CLOSE_WAIT_S)
    try:
      if locked and self._worker is not None:
        self._worker.stop()
        self._worker = None
      with self._slot_lock:
        if self._holds_slot:
          self._holds_slot = False
          self.pool._free_slot(self)
    finally:
      if locked:
        self._lock.release()

  # ----------------------------------------------------------------- calls
  async def arun(self, code: str) -> RunResult:
    """`run` on the pool's threads, for asyncio runtimes (e.g. the swarm's)."""
    return await asyncio.get_running_loop().run_in_executor(self.pool._executor, self.run, code)

  def run(self, code: str) -> RunResult:
    """Runs `code` in the session's worker (started on first use) and returns its RunResult."""
    if not isinstance(code, str):
      raise TypeError(f"code must be a str, got {type(code).__name__}")
    with self._lock:
      if not self._holds_slot or self._closing:
        raise RuntimeError("the session is not open: use `with pool.session(...) as s:` (or async with)")
      size = len(code.encode("utf-8", "replace"))
      if size > MAX_CODE_BYTES:
        return RunResult(ok=False, error=f"code of {size} bytes is longer than the {MAX_CODE_BYTES}-byte limit")
      restarted = False
      if self._worker is None:
        worker = self._worker = _Worker(self.pool.limits)   # visible to `close` while it starts
        try:
          worker.start(self.images)
        except BaseException:
          self._worker = None
          worker.stop()
          raise
        restarted, self._state_lost = self._state_lost, False
      return self._call(code, restarted)

  def _call(self, code: str, restarted: bool) -> RunResult:
    limits, worker, start = self.pool.limits, self._worker, time.monotonic()
    try:
      reply = worker.call(code, start + limits.wall_s)
    except _Failure as e:
      returncode = self._stop_worker()
      failure = e.message or _death(returncode, limits)
    except Exception as e:   # whatever the worker did, the host answers with an observation
      self._stop_worker()
      failure = f"sandbox error: {type(e).__name__}: {str(e)[:200]}"
    except BaseException:
      self._stop_worker()
      raise
    else:
      return RunResult(ok=reply["ok"], stdout=reply["stdout"], value=reply["value"], error=reply["error"],
                       restarted=restarted, blocked=reply["blocked"], cpu_s=reply["cpu_s"],
                       wall_s=time.monotonic() - start, peak_memory_mb=reply["peak_memory_mb"])
    if self._closing:
      failure = "the session was closed during the call"
    return RunResult(ok=False, error=f"{failure}; {STATE_LOST}", restarted=restarted, wall_s=time.monotonic() - start)

  def _stop_worker(self) -> int | None:
    returncode = self._worker.stop()
    self._worker, self._state_lost = None, True
    return returncode


def _check_images(images: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  checked = {}
  for name, array in images.items():
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name.startswith("__"):
      raise ValueError(f"image name {name!r} must be a Python identifier (not a keyword or dunder)")
    if name in RESERVED_NAMES:
      raise ValueError(f"image name {name!r} would hide a name of the sandbox namespace")
    array = np.asarray(array)
    if array.dtype.kind not in "biuf":
      raise ValueError(f"image {name!r} must be a bool/int/float array, got dtype {array.dtype}")
    checked[name] = array
  return checked


class SandboxPool:
  """Runs up to `max_sessions` sessions at once (each its own worker); `close` stops them all.

  `session(images)` makes a session; entering it waits for a free slot. Async calls run on
  the pool's `max_sessions` threads, so that many episodes' calls proceed together.
  """

  def __init__(self, max_sessions: int = 8, limits: Limits = Limits()):
    if not isinstance(max_sessions, int) or max_sessions < 1:
      raise ValueError(f"max_sessions must be a positive int, got {max_sessions!r}")
    if not isinstance(limits, Limits):
      raise TypeError(f"limits must be a Limits, got {type(limits).__name__}")
    self.max_sessions, self.limits = max_sessions, limits
    self._slots = threading.BoundedSemaphore(max_sessions)
    self._executor = concurrent.futures.ThreadPoolExecutor(max_sessions, thread_name_prefix="sandbox")
    self._open: set[Session] = set()
    self._lock = threading.Lock()
    self._closed = False

  def session(self, images: Mapping[str, np.ndarray] | None = None) -> Session:
    """A session whose namespace holds `images` (name → array, e.g. {"img_1": uint8 [H, W, 3]})."""
    if self._closed:
      raise RuntimeError("the SandboxPool is closed")
    return Session(self, images)

  def _take_slot(self, session: Session) -> None:
    self._slots.acquire()
    self._register(session)

  async def _atake_slot(self, session: Session) -> None:
    while not self._slots.acquire(blocking=False):
      await asyncio.sleep(0.01)
    self._register(session)

  def _register(self, session: Session) -> None:
    with self._lock:
      if self._closed:
        self._slots.release()
        raise RuntimeError("the SandboxPool is closed")
      self._open.add(session)

  def _free_slot(self, session: Session) -> None:
    with self._lock:
      self._open.discard(session)
    self._slots.release()

  @property
  def open_sessions(self) -> int:
    return len(self._open)

  def close(self) -> None:
    """Stops every open session's worker (calls in flight end at once) and the pool's threads."""
    with self._lock:
      self._closed = True
      sessions = list(self._open)
    for session in sessions:
      session.close()
    self._executor.shutdown(wait=True)

  def __enter__(self) -> SandboxPool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
