"""k25jax.agents.sandbox against the attack classes of issue 16, each as model code run through a session.

Every attack runs with the sandbox's temporary directory redirected to a directory of its own
and ends in `contained`: the host is alive and got no exception (the call returned a
RunResult), no worker process is left, no file is left in that directory or in /dev/shm, no
System V IPC object appeared, and a new session of the pool starts clean (an empty working
directory, fresh variables, correct results). The classes:

1. the reply channel: model code writes replies of its own (forged, malformed, nested,
   out of range, too long, too many) or keeps running after its reply;
2. blocking host operations: a worker that stops reading, closing during a call;
3. cleanup: trees the host's deletion must survive (3,000 levels deep, symlinks out);
4. System V IPC, POSIX message queues and shared memory;
5. the per-session disk quota;
6. host metadata: stat, inotify/fanotify, utime, xattrs, chmod/chown.

Where the kernel gives the worker a mount namespace (root here, or unprivileged user
namespaces) the defaults run; `fallback` runs the classes that differ without namespaces.
"""
import asyncio
import dataclasses
import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from k25jax.agents import sandbox
from k25jax.agents.sandbox import Limits, RunResult, SandboxPool
from test_agents_sandbox import children

LIMITS = Limits(cpu_s=1, wall_s=2, memory_mb=256, output_bytes=1024, session_cpu_s=30, start_s=60)
STATE_LOST = "the next call starts a new one"

# Model code that turns the audit hook off and reaches the worker's own variables: the reply
# pipe (`replies`), the request being served (`request`), and libc.
SETUP = """
import json
sys = np.__builtins__['__import__']('sys')
frame = sys._getframe()
while 'policy' not in frame.f_locals:
  frame = frame.f_back
type(frame.f_locals['policy']).__call__ = lambda self, event, args: None   # audit hook off
os, ctypes, signal, time = sys.modules['os'], sys.modules['ctypes'], sys.modules['signal'], sys.modules['time']
libc = ctypes.CDLL(None, use_errno=True)

def worker_locals():
  f = sys._getframe()
  while 'replies' not in f.f_locals:
    f = f.f_back
  return f.f_locals

def valid(**fields):
  '''A reply to the current call as the worker would write it, with `fields` changed.'''
  message = {'id': worker_locals()['request']['id'], 'ok': True, 'stdout': 'forged', 'value': None,
             'error': None, 'blocked': []}
  message.update(fields)
  return json.dumps(message).encode() + b'\\n'

def forge(raw=None, **fields):
  '''Writes `raw`, or a valid reply with `fields` changed, to the host.'''
  out = worker_locals()['replies']
  out.write(valid(**fields) if raw is None else raw)
  out.flush()

def exit_on_next_call():
  '''Takes the next request from the pipe and exits: the worker's own reply never comes.'''
  worker_locals()['requests'].readline()
  os._exit(0)

def errno_of(call):
  try:
    call()
  except OSError as e:
    return e.errno
  return 0

def libc_errno(result):
  return ctypes.get_errno() if result == -1 else 0
"""


def ipc_objects() -> dict[str, list[str]]:
  """The host's System V IPC objects (key and id of each)."""
  objects = {}
  for kind in ("shm", "msg", "sem"):
    with open(f"/proc/sysvipc/{kind}") as f:
      objects[kind] = sorted(" ".join(line.split()[:2]) for line in f.read().splitlines()[1:])
  return objects


def process_state(pid: int) -> str:
  with open(f"/proc/{pid}/stat") as f:
    return f.read().rsplit(")", 1)[1].split()[0]


def cpu_ticks(pid: int) -> int:
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return int(fields[11]) + int(fields[12])


@pytest.fixture(scope="module")
def pool():
  with SandboxPool(max_sessions=4, limits=LIMITS) as pool:
    yield pool


@pytest.fixture(scope="module")
def cpu_pool():
  """Wall time to spare, so that the CPU limit is what stops a loop even on a loaded machine."""
  with SandboxPool(max_sessions=1, limits=Limits(cpu_s=1, wall_s=30, memory_mb=256, start_s=60)) as pool:
    yield pool


NEXT_SESSION = "np.__builtins__['__import__']('os').listdir('.'), int(img_1.sum()), 'libc' in dir()"


@pytest.fixture
def contained(pool, tmp_path, monkeypatch):
  """The attack's sandbox directories go to tmp_path; afterwards everything must be as before."""
  sandbox_tmp = tmp_path / "sandbox"
  sandbox_tmp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(sandbox_tmp))
  before = children(), ipc_objects(), sorted(os.listdir("/dev/shm"))
  yield sandbox_tmp
  assert children() == before[0], "a worker outlived its session"
  assert os.listdir(sandbox_tmp) == [], "a file of the sandbox was left"
  assert ipc_objects() == before[1], "an IPC object was left"
  assert sorted(os.listdir("/dev/shm")) == before[2], "a file was left in /dev/shm"
  with pool.session(images={"img_1": np.full((4, 4, 3), 7, np.uint8)}) as s:   # the next session is clean
    result = s.run(NEXT_SESSION)
    assert result.ok and result.value == "([], 336, False)", result
    assert process_state(s.pid) == "T"   # stopped between calls


@pytest.fixture
def fallback(monkeypatch):
  """Workers without namespaces: what the sandbox does where the kernel allows none."""
  monkeypatch.setattr(sandbox, "USE_NAMESPACES", False)


def assert_failed(result: RunResult, message: str, restarted: bool = True) -> None:
  assert isinstance(result, RunResult) and not result.ok, result
  assert message in result.error, result.error
  if restarted:
    assert STATE_LOST in result.error, result.error


def run_attack(pool, code: str) -> tuple[RunResult, RunResult]:
  """Runs `code` in a new session (after SETUP); returns its result and the first good call after
  it: the session goes on (in a new worker when it had to; a call may first meet what the attack
  left running)."""
  with pool.session() as s:
    assert s.run(SETUP).ok
    result = s.run(code)
    after = s.run("40 + 2")
    if not after.ok:
      after = s.run("40 + 2")
  assert after.ok and after.value == "42", after
  return result, after


# ----------------------------------------------------------------- 1. the reply channel
def test_a_forged_reply_cannot_keep_the_worker_running_between_calls(cpu_pool, contained):
  with cpu_pool.session() as s:
    assert s.run(SETUP).ok
    forged = s.run("forge()\nsignal.setitimer(signal.ITIMER_PROF, 0)   # the per-call timer off\nwhile True:\n  pass")
    assert forged.ok and forged.stdout == "forged"   # the model may write its own observation...
    pid, ticks = s.pid, cpu_ticks(s.pid)
    time.sleep(0.5)
    assert process_state(pid) == "T" and cpu_ticks(pid) == ticks   # ...but nothing runs between calls
    result = s.run("1")   # the loop resumes inside this call, which the host's CPU clock bounds
    assert_failed(result, "cpu-time limit of 1 s per call exceeded")
    assert s.run("1").value == "1"


def test_the_per_call_cpu_limit_holds_with_the_worker_timer_disarmed(cpu_pool, contained):
  result, after = run_attack(cpu_pool, "signal.setitimer(signal.ITIMER_PROF, 0)\nsignal.signal(signal.SIGPROF, signal.SIG_IGN)\nwhile True:\n  pass")
  assert_failed(result, "cpu-time limit of 1 s per call exceeded")
  assert after.restarted


@pytest.mark.parametrize("code, message", [
    ("forge(raw=b'[' * 50000 + b'\\n')", "nested deeper than its format"),
    ("forge(raw=b'{\"a\": ' * 10000 + b'\\n')", "nested deeper than its format"),
    ("forge(raw=b'{\"id\": [[[[1]]]], \"x\": \"[[[[[\"}\\n')", "nested deeper than its format"),
    ("forge(cpu_s=10**400)", "a number"),
    ("forge(raw=b'{\"id\": NaN, \"ok\": Infinity}\\n')", "a number"),
    ("forge(raw=b'{\"id\": 1e999}\\n')", "a number"),
    ("forge(raw=b'{\"id\": ' + b'9' * 5000 + b'}\\n')", "a number"),
    ("forge(raw=b'\\xff\\xfe not utf-8\\n')", "not valid JSON"),
    ("forge(raw=b'[1, 2]\\n')", "a number"),
    ("forge(raw=b'\"just a string\"\\n')", "without exactly the fields"),
    ("forge(raw=b'{\"ok\": true}\\n')", "without exactly the fields"),
    ("forge(extra='field')", "without exactly the fields"),
    ("forge(id='0' * 32)", "a reply to another call"),
    ("forge(ok='yes')", "'ok' is not a bool"),
    ("forge(stdout=None)", "'stdout' is a NoneType"),
    ("forge(stdout='x' * 5000)", "'stdout' is longer than 1024 bytes"),
    ("forge(blocked=['x'] * 1000)", "'blocked' is not a list"),
    ("forge(ok=True, error='but failed')", "'ok' and 'error' disagree"),
    ("forge(raw=valid() + valid())", "more than one reply"),
    ("forge(raw=b'x' * 10**7)", "a reply longer than"),
    ("forge(raw=b'{\"id\": \"')\ntime.sleep(60)", "timeout after 2 s"),
], ids=["array-nesting", "object-nesting", "nesting-in-fields", "huge-int", "nan-infinity", "float-overflow",
        "int-digits", "bad-utf8", "array-reply", "string-reply", "missing-fields", "extra-field", "stale-id",
        "ok-not-bool", "stdout-not-str", "stdout-too-long", "blocked-too-long", "ok-error-disagree",
        "two-replies", "endless-line", "partial-line"])
def test_a_malformed_reply_is_an_error_observation(pool, contained, code, message):
  result, after = run_attack(pool, code)
  assert_failed(result, message)
  assert message.startswith("timeout") or result.error.startswith("sandbox protocol error: ")
  assert after.restarted


def test_a_forged_reply_with_a_lone_surrogate_is_made_safe(pool, contained):
  result, _ = run_attack(pool, "forge(stdout='\\ud800 x', value='\\udfff', blocked=['\\ud834'])\nexit_on_next_call()")
  assert result.ok and result.stdout == "? x" and result.value == "?" and result.blocked == ("?",)
  (result.stdout + result.value).encode("utf-8")   # what a tokenizer does next: no exception


def test_a_reply_written_outside_a_call_ends_the_worker(pool, contained):
  with pool.session() as s:
    assert s.run(SETUP).ok
    # a valid reply now, a second one later: the worker is stopped before it can write it, and
    # when the next call resumes it, the host takes it as that call's reply (the wrong id)
    assert s.run("forge()\ntime.sleep(0.2)\nforge()\nwhile True:\n  pass").ok
    assert_failed(s.run("1"), "sandbox protocol error: a reply to another call")


def test_closing_the_reply_pipe_ends_the_worker(pool, contained):
  result, after = run_attack(pool, "worker_locals()['replies'].close()\ntime.sleep(60)")
  assert_failed(result, "sandbox protocol error: the worker closed its reply pipe")
  assert after.restarted


def test_closing_the_request_pipe_ends_the_worker(pool, contained):
  with pool.session() as s:
    assert s.run(SETUP).ok
    assert s.run("forge()\nworker_locals()['requests'].close()\ntime.sleep(60)").ok
    assert_failed(s.run("#" * 100000), "sandbox protocol error: the worker closed its request pipe")


def test_a_worker_that_steals_the_next_request_is_still_bounded(cpu_pool, contained):
  # the code keeps serving calls itself: reads each request and answers with its own replies
  code = ("forge()\nrequests = worker_locals()['requests']\nwhile True:\n"
          "  request = json.loads(requests.readline())\n"
          "  worker_locals()['replies'].write(json.dumps({'id': request['id'], 'ok': True, 'stdout': 'mine', "
          "'value': None, 'error': None, 'blocked': []}).encode() + b'\\n'); worker_locals()['replies'].flush()\n"
          "  while True:\n    pass")
  with cpu_pool.session() as s:
    assert s.run(SETUP).ok
    assert s.run(code).stdout == "forged"
    assert s.run("1").stdout == "mine"   # an observation of its own choosing, like print
    assert_failed(s.run("1"), "cpu-time limit of 1 s per call exceeded")   # but no CPU beyond the call's


# ----------------------------------------------------------------- 2. blocking host operations
def test_a_worker_that_stops_reading_cannot_block_the_host(pool, contained):
  with pool.session() as s:
    assert s.run(SETUP).ok
    assert s.run("forge()\ntime.sleep(1000)").ok   # answers, then never reads again
    start = time.monotonic()
    result = s.run("#" * (sandbox.MAX_CODE_BYTES - 10))   # more than a pipe holds
    assert_failed(result, "timeout after 2 s (wall-time limit)")
    assert time.monotonic() - start < LIMITS.wall_s + 2


def test_closing_the_pool_during_a_call_ends_it_at_once(contained):
  pool = SandboxPool(2, Limits(cpu_s=60, wall_s=60, memory_mb=256, start_s=60))
  session = pool.session().__enter__()
  assert session.run(SETUP).ok
  results = []
  call = threading.Thread(target=lambda: results.append(session.run(
      "signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())\ntime.sleep(600)")))
  call.start()
  time.sleep(0.5)
  start = time.monotonic()
  pool.close()
  call.join(10)
  assert not call.is_alive() and time.monotonic() - start < 5
  assert_failed(results[0], "the session was closed during the call")
  assert pool.open_sessions == 0


def test_closing_a_session_whose_worker_ignores_signals_is_prompt(pool, contained):
  with pool.session() as s:
    assert s.run(SETUP).ok
    assert s.run("for n in (1, 2, 3, 15, 18):\n  signal.signal(n, signal.SIG_IGN)\nforge()\nwhile True:\n  pass").ok
    start = time.monotonic()
  assert time.monotonic() - start < 2


def test_async_close_after_the_pool_closed_does_not_raise(contained):
  async def main():
    pool = SandboxPool(1, LIMITS)
    async with pool.session() as s:
      await s.arun(SETUP)
      pool.close()
  asyncio.run(main())


def test_the_host_log_is_not_the_model_s_to_write(pool, contained):
  with pool.session() as s:
    assert s.run(SETUP).ok
    log = os.path.join(s._worker.base, "worker.log")
    size = os.path.getsize(log)
    result = s.run("chunk = b'x' * 2**20\nfor _ in range(64):\n  os.write(2, chunk)\nos.fstat(2).st_size")
    assert result.ok and result.value == "0"   # descriptor 2 is /dev/null
    assert os.path.getsize(log) == size


# ----------------------------------------------------------------- 3. cleanup that can raise
DEEP_TREE = ("fd = os.open('.', os.O_RDONLY)\nfor i in range(3000):\n  os.mkdir('a', dir_fd=fd)\n"
             "  inner = os.open('a', os.O_RDONLY, dir_fd=fd); os.close(fd); fd = inner\n"
             "os.close(fd)\n'deep'")


def test_a_3000_deep_tree_is_removed_and_frees_the_slot(contained):
  # Building the tree is not the attack (its removal is): 3,000 mkdirs cost more than a
  # second of kernel time on a loaded CI machine, so this call gets more CPU than LIMITS.
  pool = SandboxPool(1, dataclasses.replace(LIMITS, cpu_s=10, wall_s=20))
  with pool.session() as s:
    assert s.run(SETUP).ok
    result = s.run(DEEP_TREE)
    assert result.ok and result.value == "'deep'"
  with pool.session() as s:   # the only slot is free again
    assert s.run("1").ok
  pool.close()


def test_a_3000_deep_tree_without_namespaces(fallback, contained):
  pool = SandboxPool(1, LIMITS)
  with pool.session() as s:
    assert s.run(SETUP).ok
    assert_failed(s.run(DEEP_TREE), "disk quota of 64 MB")   # the watcher stops at 64 levels
    assert s.run(SETUP).ok
    assert s.run(DEEP_TREE.replace("3000", "60")).ok   # under the watcher's depth: removed at close
  with pool.session() as s:
    assert s.run("1").ok
  pool.close()


def test_removing_a_tree_never_recurses_and_never_follows_links(tmp_path):
  if os.path.isdir("/dev/shm"):   # a tmpfs: removing 3,000 directories from a disk takes seconds
    tmp_path = pathlib.Path(tempfile.mkdtemp(dir="/dev/shm"))
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep").write_text("host data")
  top = tmp_path / "tree"
  top.mkdir()
  fd = os.open(top, os.O_RDONLY)
  for _ in range(3000):
    os.symlink(str(outside), "link", dir_fd=fd)
    with open(os.open("f\nwith newline", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as f:
      f.write("x")
    os.mkdir("d", dir_fd=fd)
    inner = os.open("d", os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = inner
  os.close(fd)
  assert sandbox.remove_tree(str(top)) and not top.exists()
  assert (outside / "keep").read_text() == "host data"
  assert sandbox.remove_tree(str(top))   # gone already: still True, no exception
  shutil.rmtree(tmp_path)


def test_a_failing_cleanup_still_frees_the_slot(contained, monkeypatch):
  def remove_then_fail(path):
    shutil.rmtree(path)
    raise RecursionError("maximum recursion depth exceeded")
  monkeypatch.setattr(sandbox, "remove_tree", remove_then_fail)
  pool = SandboxPool(1, LIMITS)
  with pool.session() as s:
    s.run("1")
  got = []
  waiter = threading.Thread(target=lambda: got.append(pool.session().__enter__()), daemon=True)
  waiter.start()
  waiter.join(5)
  assert got, "the slot leaked"
  got[0].close()
  pool.close()


@pytest.mark.parametrize("code", [
    "os.chmod('.', 0)",
    "open('f', 'w').close(); os.chmod('f', 0)",
    "os.mkdir('d'); os.chown('d', 0, 0)",
], ids=["chmod-cwd", "chmod-file", "chown-dir"])
def test_trees_the_host_could_not_delete_cannot_be_made(pool, contained, code):
  result, _ = run_attack(pool, code)
  assert_failed(result, "PermissionError: [Errno 1]", restarted=False)


# ----------------------------------------------------------------- 4. System V IPC and shared memory
IPC_ATTACKS = {
    "shmget-500MB": "libc_errno(libc.shmget(0, 500 * 2**20, 0o1600))",
    "shmat": "libc_errno(libc.shmat(0, None, 0))",
    "msgget": "libc_errno(libc.msgget(0x4b32, 0o1666))",
    "msgrcv": "libc_errno(libc.msgrcv(0, None, 16, 0, 0o4000))",
    "semget": "libc_errno(libc.semget(0x4b33, 1, 0o1666))",
    "mq_open": "libc_errno(libc.syscall(240, b'k25jax', 0o102, 0o600, None))",
    "memfd_create": "libc_errno(libc.memfd_create(b'x', 0))",
    "dev-shm": "errno_of(lambda: open('/dev/shm/k25jax_sandbox_attack', 'w').write('x'))",
}


@pytest.mark.parametrize("name", sorted(IPC_ATTACKS))
def test_system_v_ipc_and_shared_memory_are_refused(pool, contained, name):
  if name == "mq_open" and os.uname().machine != "x86_64":
    pytest.skip("the syscall number is x86_64's")
  result, _ = run_attack(pool, IPC_ATTACKS[name])
  refused = {errno.EPERM} if name != "dev-shm" else {errno.ENOENT, errno.EACCES}
  assert result.ok and int(result.value) in refused, result


def test_a_message_queue_cannot_carry_a_secret_to_the_next_session(pool, contained):
  send = ("class M(ctypes.Structure): _fields_ = [('t', ctypes.c_long), ('x', ctypes.c_char * 16)]\n"
          "q = libc.msgget(0x4b34, 0o1666)\nq, libc.msgsnd(q, ctypes.byref(M(1, b'secret')), 16, 0) if q >= 0 else None")
  receive = ("class M(ctypes.Structure): _fields_ = [('t', ctypes.c_long), ('x', ctypes.c_char * 16)]\n"
             "m = M()\nq = libc.msgget(0x4b34, 0)\nq, (libc.msgrcv(q, ctypes.byref(m), 16, 0, 0o4000), m.x) if q >= 0 else None")
  sent, _ = run_attack(pool, send)
  received, _ = run_attack(pool, receive)
  assert sent.value == "(-1, None)" and received.value == "(-1, None)"


def test_the_worker_has_its_own_ipc_namespace(pool, contained):
  with pool.session() as s:
    s.run("0")
    if not s.confinement["ipc_namespace"]:
      pytest.skip(f"no IPC namespace here: {s.confinement['isolation_error']}")
    assert os.readlink(f"/proc/{s.pid}/ns/ipc") != os.readlink("/proc/self/ns/ipc")
    assert os.readlink(f"/proc/{s.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")


# ----------------------------------------------------------------- 5. the disk quota
FILL_DISK = "z = b'\\1' * 16 * 2**20\nfor i in range(48):\n  open(f'f{i}', 'wb').write(z)"
MANY_FILES = "for i in range(20000):\n  open(f'f{i}', 'w').close()"


def test_writing_768_mb_stops_at_the_disk_quota(pool, contained):
  free = shutil.disk_usage(tempfile.gettempdir()).free
  with pool.session() as s:
    result = s.run(FILL_DISK)
    if s.confinement["disk_quota_mb"] is None:
      pytest.skip("no tmpfs here (see the fallback test)")
    assert_failed(result, "OSError: [Errno 28] No space left on device", restarted=False)
    used = sum(os.path.getsize(os.path.join(s.work_dir, name)) for name in os.listdir(s.work_dir))
    assert used <= LIMITS.disk_mb * 2**20
  assert shutil.disk_usage(tempfile.gettempdir()).free > free - 32 * 2**20   # the host's disk untouched


def test_many_files_stop_at_the_file_quota(pool, contained):
  with pool.session() as s:
    result = s.run(MANY_FILES)
    if s.confinement["disk_quota_mb"] is None:
      pytest.skip("no tmpfs here (see the fallback test)")
    assert_failed(result, "No space left on device", restarted=False)
    assert len(os.listdir(s.work_dir)) < sandbox.MAX_FILES


@pytest.mark.parametrize("code", [FILL_DISK, MANY_FILES], ids=["768MB", "20000-files"])
def test_the_disk_quota_without_namespaces(fallback, contained, monkeypatch, code):
  monkeypatch.setattr(sandbox, "MAX_FILES", 1000)   # files on a real disk are slow to make: a smaller cap
  with SandboxPool(1, Limits(cpu_s=20, wall_s=30, memory_mb=256)) as pool, pool.session() as s:   # CPU to spare
    result = s.run(code)
    assert s.confinement is None or s.confinement["disk_quota_mb"] is None
  assert_failed(result, "disk quota of 64 MB (1000 files, 64 levels) exceeded")


# ----------------------------------------------------------------- 6. host metadata
@pytest.fixture
def host_file():
  """A world-writable file in a world-writable directory of /tmp: what Landlock alone left open
  to stat, inotify, utime and xattrs of a `nobody` worker."""
  directory = pathlib.Path(tempfile.mkdtemp(prefix="k25jax_host_", dir="/tmp"))
  os.chmod(directory, 0o777)
  path = directory / "host_file"
  path.write_text("host")
  os.chmod(path, 0o666)
  os.utime(path, (1, 1))
  yield path
  shutil.rmtree(directory)


METADATA_ATTACKS = {
    "stat-shadow": ("errno_of(lambda: os.stat('/etc/shadow'))", {errno.ENOENT}),
    "stat-host-file": ("errno_of(lambda: os.stat('{path}'))", {errno.ENOENT}),
    "stat-own-log": ("errno_of(lambda: os.stat('../worker.log'))", {errno.ENOENT}),
    "list-proc": ("errno_of(lambda: os.listdir('/proc'))", {errno.ENOENT, errno.EACCES}),
    "access-host-file": ("errno_of(lambda: os.access('{path}', 0) or os.stat('{path}'))", {errno.ENOENT}),
    "inotify": ("libc_errno(libc.inotify_init1(0))", {errno.EPERM}),
    "fanotify": ("libc_errno(libc.fanotify_init(0, 0))", {errno.EPERM}),
    "utime": ("errno_of(lambda: os.utime('{path}'))", {errno.EPERM}),
    "utime-tmp": ("errno_of(lambda: os.utime('/tmp'))", {errno.EPERM}),
    "setxattr": ("errno_of(lambda: os.setxattr('{path}', 'user.x', b'1'))", {errno.EPERM}),
    "getxattr": ("errno_of(lambda: os.listxattr('{path}'))", {errno.EPERM}),
    "chmod-host-file": ("errno_of(lambda: os.chmod('{path}', 0o777))", {errno.EPERM}),
    "statfs-host": ("errno_of(lambda: os.statvfs('/etc'))", {errno.ENOENT}),
}


@pytest.mark.parametrize("name", sorted(METADATA_ATTACKS))
def test_host_metadata_is_out_of_reach(pool, contained, host_file, name):
  code, refused = METADATA_ATTACKS[name]
  result, _ = run_attack(pool, code.format(path=host_file))
  assert result.ok and int(result.value) in refused, result
  assert os.stat(host_file).st_mtime == 1 and os.listxattr(host_file) == []
  assert os.stat(host_file).st_mode & 0o777 == 0o666


def test_inotify_shows_no_host_file_names(pool, contained, host_file):
  with pool.session() as s:
    assert s.run(SETUP).ok
    watch = s.run(f"fd = libc.inotify_init1(0o4000)\nfd, libc_errno(fd), (libc.inotify_add_watch(fd, b'{host_file.parent}', 0x100) if fd >= 0 else None)")
    (host_file.parent / "created_by_host").write_text("x")
    assert watch.value == f"(-1, {errno.EPERM}, None)", watch


@pytest.mark.parametrize("name", ["inotify", "utime", "setxattr", "chmod-host-file", "fanotify"])
def test_metadata_changes_are_refused_without_namespaces(fallback, pool, contained, host_file, name):
  # without a mount namespace the host's paths are visible (stat works: seccomp cannot read a
  # path argument, Landlock does not mediate stat), but changes and watches stay refused
  code, _ = METADATA_ATTACKS[name]
  result, _ = run_attack(pool, code.format(path=host_file))
  assert result.ok and int(result.value) == errno.EPERM, result
  assert os.stat(host_file).st_mtime == 1 and os.listxattr(host_file) == []


# ----------------------------------------------------------------- other sessions
@pytest.mark.parametrize("call", [
    "libc.setpriority(0, {pid}, 19)",
    "libc.sched_setaffinity({pid}, 8, ctypes.byref(ctypes.c_ulong(1)))",
    "libc.syscall(279, {pid}, 0, None, None, None, 0)",   # move_pages on x86_64
], ids=["setpriority", "sched_setaffinity", "move_pages"])
def test_another_session_s_worker_is_out_of_reach(pool, contained, call):
  if "279" in call and os.uname().machine != "x86_64":
    pytest.skip("the syscall number is x86_64's")
  with pool.session() as victim:
    victim.run("0")
    result, _ = run_attack(pool, f"r = {call.format(pid=victim.pid)}\nr, libc_errno(r)")
    assert result.value == f"(-1, {errno.EPERM})", result
    with open(f"/proc/{victim.pid}/stat") as f:
      assert f.read().rsplit(")", 1)[1].split()[16] == "0"   # its nice value


# ----------------------------------------------------------------- a host that is not root
NON_ROOT_HOST = """
import json, os, sys
sys.path.insert(0, {repo!r})
from k25jax.agents.sandbox import Limits, SandboxPool
out = {{"euid": os.geteuid()}}
with SandboxPool(1, Limits(cpu_s=2, wall_s=5, memory_mb=256)) as pool, pool.session(images={{"img": __import__("numpy").ones((2, 2))}}) as s:
  out["sum"] = s.run("float(img.sum())").value
  out["confinement"] = s.confinement
  esc = "np.__builtins__['__import__']"
  out["stat"] = s.run(f"{{esc}}('os').stat('/etc/passwd')").error
  out["disk"] = s.run("z = b'1' * 2**20\\nfor i in range(100):\\n  open(f'f{{i}}', 'wb').write(z)").error
print(json.dumps(out))
"""


def test_a_non_root_host_gets_the_same_isolation_from_a_user_namespace(tmp_path):
  """The host as uid 1000 (itself in a user namespace made by `unshare`): workers then make
  their own user namespace for the mount and IPC namespaces, and keep the host's uid."""
  unshare = shutil.which("unshare")
  if os.geteuid() != 0 or unshare is None:
    pytest.skip("needs root and unshare(1) to make a non-root host")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = tmp_path / "host.py"
  script.write_text(NON_ROOT_HOST.format(repo=repo))
  os.chmod(tmp_path, 0o755)
  run = subprocess.run([unshare, "--user", "--map-user=1000", "--map-group=1000", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=120, env={"PATH": os.environ.get("PATH", ""),
                                                                         "TMPDIR": str(tmp_path)})
  if run.returncode != 0 and "unshare failed" in run.stderr:
    pytest.skip(f"user namespaces are not available: {run.stderr.strip()}")
  assert run.returncode == 0, run.stderr
  out = json.loads(run.stdout)
  assert out["euid"] == 1000 and out["sum"] == "4.0"
  confinement = out["confinement"]
  if not confinement["user_namespace"]:
    pytest.skip(f"no nested user namespace here: {confinement['isolation_error']}")
  assert confinement["uid"] == 1000 and confinement["mount_namespace"] and confinement["ipc_namespace"]
  assert "No such file or directory: '/etc/passwd'" in out["stat"]
  assert "No space left on device" in out["disk"]
  assert os.listdir(tmp_path) == ["host.py"]
