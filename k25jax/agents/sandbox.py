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

* host side (here): wall time, by killing the worker's process group; the reply size;
  a fresh temporary directory per worker, removed with it; a minimal environment;
* worker side, by the kernel (the real boundary): CPU time per call (ITIMER_PROF) and
  per session (RLIMIT_CPU), address space (RLIMIT_AS), no new processes or threads
  (RLIMIT_NPROC 0; the worker drops to `nobody` when started as root, where the limit
  would not bind), file size, open files, no core dumps; Landlock (files only beneath
  the working directory, read-only beneath the NumPy and standard-library directories)
  and seccomp (no sockets, fork, exec, signals or tracing of other processes, rlimit
  changes, namespaces): see `sandbox_confine.py`, and `Session.confinement` for what the
  running kernel provided;
* worker side, by an audit hook, with clear errors: imports outside the allow-list,
  opening files outside those directories, sockets, process creation, signals, ctypes,
  mmap, rlimit changes, file-system changes. Python code can patch it; the kernel
  layers hold regardless (tested);
* model-visible builtins: `__import__` limited to the allow-list.

A call that breaks a limit returns ok=False with a clear error. When the worker had to die
(CPU or wall time, a crash), the error says so and the next call starts a new worker with
the variables lost, reported as `restarted=True`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import keyword
import os
import pwd
import select
import shutil
import signal
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


class SandboxError(RuntimeError):
  """The sandbox itself failed (a worker that does not start): not the model's fault."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-call and per-session limits of a sandbox worker.

  cpu_s: CPU seconds per call. wall_s: wall seconds per call. memory_mb: address space the
  code may add to the worker's start-up footprint (Python + NumPy, ~100 MB).
  output_bytes: stdout (and stderr) kept per call, and the longest repr of a value.
  file_mb: largest file the code may write. open_files: descriptors beyond start-up.
  session_cpu_s: CPU seconds over the whole session (a worker is killed past it).
  start_s: wall seconds a worker may take to start (Python + NumPy import; more under load).
  """

  cpu_s: float = 2.0
  wall_s: float = 5.0
  memory_mb: int = 512
  output_bytes: int = 8192
  file_mb: int = 16
  open_files: int = 16
  session_cpu_s: float = 60.0
  start_s: float = 60.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"Limits.{field.name} must be a positive number, got {value!r}")
    for name in ("memory_mb", "output_bytes", "file_mb", "open_files"):
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
  even ones the code caught. cpu_s, wall_s: time the call took; peak_memory_mb: the
  worker's peak resident memory so far.
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


def _death(returncode: int, limits: Limits) -> str:
  if returncode == -signal.SIGPROF:
    return f"cpu-time limit of {limits.cpu_s:g} s per call exceeded"
  if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
    return f"cpu-time limit of {limits.session_cpu_s:g} s per session exceeded (or the worker was killed)"
  if returncode < 0:
    return f"the worker died from signal {signal.Signals(-returncode).name}"
  return f"the worker exited with code {returncode}"


class _Worker:
  """One worker process, its directory (work/ is the code's cwd) and the reply buffer."""

  def __init__(self, images: Mapping[str, np.ndarray], limits: Limits):
    self.limits = limits
    self.base = tempfile.mkdtemp(prefix="k25jax_sandbox_")
    self._buffer = b""
    self.proc = None
    try:
      self._spawn(images)
    except BaseException:
      self.stop()
      raise

  def _spawn(self, images: Mapping[str, np.ndarray]) -> None:
    work, image_dir = os.path.join(self.base, "work"), os.path.join(self.base, "images")
    os.mkdir(work, 0o700)
    os.mkdir(image_dir, 0o700)
    for name, array in images.items():
      np.save(os.path.join(image_dir, name + ".npy"), array, allow_pickle=False)
    user = _sandbox_user()
    if user is not None:
      os.chown(work, *user)
    config = {
        "image_dir": image_dir, "image_names": sorted(images), "image_ops_path": image_ops.__file__,
        "read_roots": [os.path.dirname(np.__file__), sysconfig.get_paths()["stdlib"]],
        "uid": user and user[0], "gid": user and user[1],
        "limits": {k: v for k, v in dataclasses.asdict(self.limits).items() if k not in ("wall_s", "start_s")},
    }
    with open(os.path.join(self.base, "worker.log"), "wb") as log:
      self.proc = subprocess.Popen(
          [sys.executable, "-I", "-B", WORKER_PATH, json.dumps(config)],
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=work,
          env=_worker_environment(work), start_new_session=True, close_fds=True, bufsize=0)
    try:
      ready = self.read_reply(time.monotonic() + self.limits.start_s)
    except TimeoutError:
      ready = None
    if not ready or ready.get("ready") is not True:
      raise SandboxError(f"the sandbox worker did not start: {self._log_tail()}")
    self.confinement = {"uid": ready["uid"], **ready["confinement"]}

  def _log_tail(self, size: int = 2000) -> str:
    try:
      with open(os.path.join(self.base, "worker.log"), "rb") as log:
        return log.read()[-size:].decode("utf-8", "replace") or "(no output)"
    except OSError:
      return "(no log)"

  def send(self, message: dict) -> bool:
    """Writes one request; False when the worker is gone."""
    data = memoryview(json.dumps(message).encode() + b"\n")
    try:
      while data:
        data = data[self.proc.stdin.write(data):]
      return True
    except (BrokenPipeError, ValueError):
      return False

  def read_reply(self, deadline: float) -> dict | None:
    """The next reply line as a dict; None at end of file; TimeoutError past `deadline`;
    ValueError for a reply that is not a JSON object or is too long."""
    fd = self.proc.stdout.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    cap = 16 * self.limits.output_bytes + (1 << 20)
    while b"\n" not in self._buffer:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        raise TimeoutError
      if not poller.poll(remaining * 1000):
        continue
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        return None
      self._buffer += chunk
      if len(self._buffer) > cap:
        raise ValueError(f"a reply longer than {cap} bytes")
    line, _, self._buffer = self._buffer.partition(b"\n")
    reply = json.loads(line)
    if not isinstance(reply, dict):
      raise ValueError("a reply that is not a JSON object")
    return reply

  def stop(self) -> int | None:
    """Kills the worker's process group, reaps it and removes its directory; the return code."""
    returncode = None
    if self.proc is not None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)   # the group: anything it started dies too
      except ProcessLookupError:
        pass
      returncode = self.proc.wait()
      self.proc.stdin.close()
      self.proc.stdout.close()
      self.proc = None
    shutil.rmtree(self.base, ignore_errors=True)
    return returncode


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
    self._lock = threading.Lock()
    self._holds_slot = False

  @property
  def pid(self) -> int | None:
    """The process id of the session's worker, None while none runs."""
    return self._worker.proc.pid if self._worker is not None else None

  @property
  def confinement(self) -> dict | None:
    """The kernel layers the worker runs under: {"uid", "landlock_abi" (0: none), "seccomp",
    "unreadable_roots"}; None while no worker runs."""
    return self._worker.confinement if self._worker is not None else None

  @property
  def work_dir(self) -> str | None:
    """The worker's working directory (removed with it), None while none runs."""
    return os.path.join(self._worker.base, "work") if self._worker is not None else None

  # ----------------------------------------------------------------- life cycle
  def __enter__(self) -> Session:
    self._check_not_open()
    self.pool._take_slot(self)
    self._holds_slot = True
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  async def __aenter__(self) -> Session:
    self._check_not_open()
    await self.pool._atake_slot(self)
    self._holds_slot = True
    return self

  async def __aexit__(self, *exc) -> None:
    await asyncio.get_running_loop().run_in_executor(self.pool._executor, self.close)

  def _check_not_open(self) -> None:
    if self._holds_slot:
      raise RuntimeError("the session is already open")

  def close(self) -> None:
    """Stops the worker (no process or directory is left) and frees the pool slot."""
    with self._lock:
      if self._worker is not None:
        self._worker.stop()
        self._worker = None
      if self._holds_slot:
        self._holds_slot = False
        self.pool._free_slot(self)

  # ----------------------------------------------------------------- calls
  async def arun(self, code: str) -> RunResult:
    """`run` on the pool's threads, for asyncio runtimes (e.g. the swarm's)."""
    return await asyncio.get_running_loop().run_in_executor(self.pool._executor, self.run, code)

  def run(self, code: str) -> RunResult:
    """Runs `code` in the session's worker (started on first use) and returns its RunResult."""
    if not isinstance(code, str):
      raise TypeError(f"code must be a str, got {type(code).__name__}")
    with self._lock:
      if not self._holds_slot:
        raise RuntimeError("the session is not open: use `with pool.session(...) as s:` (or async with)")
      size = len(code.encode("utf-8", "replace"))
      if size > MAX_CODE_BYTES:
        return RunResult(ok=False, error=f"code of {size} bytes is longer than the {MAX_CODE_BYTES}-byte limit")
      restarted = False
      if self._worker is None:
        self._worker = _Worker(self.images, self.pool.limits)
        restarted, self._state_lost = self._state_lost, False
      return self._call(code, restarted)

  def _call(self, code: str, restarted: bool) -> RunResult:
    limits, start = self.pool.limits, time.monotonic()
    worker = self._worker
    try:
      reply = worker.read_reply(start + limits.wall_s) if worker.send({"code": code}) else None
      failure = None if reply is not None else _death(self._stop_worker(), limits)
    except TimeoutError:
      self._stop_worker()
      failure = f"timeout after {limits.wall_s:g} s (wall-time limit)"
    except ValueError as e:   # the worker wrote something that is not a reply
      self._stop_worker()
      failure = f"sandbox protocol error: {e}"
    wall = time.monotonic() - start
    if failure is not None:
      return RunResult(ok=False, error=f"{failure}; {STATE_LOST}", restarted=restarted, wall_s=wall)
    try:
      return RunResult(
          ok=bool(reply["ok"]), stdout=str(reply["stdout"]), value=reply["value"], error=reply["error"],
          restarted=restarted, blocked=tuple(reply["blocked"]), cpu_s=float(reply["cpu_s"]),
          wall_s=wall, peak_memory_mb=float(reply["peak_memory_mb"]))
    except (KeyError, TypeError, ValueError) as e:
      self._stop_worker()
      return RunResult(ok=False, error=f"sandbox protocol error: bad reply field {e}; {STATE_LOST}",
                       restarted=restarted, wall_s=wall)

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
    """Stops every open session's worker and the pool's threads."""
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
