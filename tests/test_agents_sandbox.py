"""k25jax.agents.sandbox: sessions, limits, the security cases (each contained, host checked), load.

Every security test checks two things: the call fails with a clear error, and the host is
unharmed (no file created, no process left, the worker's memory bounded, the session usable).
"""
import asyncio
import errno
import os
import signal
import tempfile
import uuid

import numpy as np
import pytest

from k25jax.agents import sandbox_confine
from k25jax.agents.sandbox import MAX_CODE_BYTES, Limits, RunResult, SandboxError, SandboxPool

LIMITS = Limits(cpu_s=1, wall_s=2, memory_mb=256, output_bytes=1024, session_cpu_s=30, start_s=60)
ESCAPE = "np.__builtins__['__import__']"   # real builtins, reached through a module's globals
SUBCLASS_ESCAPE = ("[c for c in ().__class__.__base__.__subclasses__() "
                   "if c.__name__ == '_wrap_close'][0].__init__.__globals__")   # os's globals


def scene(red_squares: int) -> np.ndarray:
  """A black 16x40 uint8 image with `red_squares` separate 2x2 red squares on one row."""
  img = np.zeros((16, 40, 3), np.uint8)
  for j in range(red_squares):
    img[2:4, 4 * j:4 * j + 2] = (255, 0, 0)
  return img


def children() -> set[int]:
  """Process ids of this process's children (a zombie is still one); a thread that ends
  while they are listed had none left (its children go to another thread)."""
  found = set()
  for task in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{task}/children") as f:
        found.update(int(pid) for pid in f.read().split())
    except FileNotFoundError:
      continue
  return found


def process_group(pgid: int) -> set[int]:
  members = set()
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if int(fields[2]) == pgid:   # field 5 of stat: the process group
        members.add(int(entry))
  return members


def limits_of(pid: int) -> dict[str, str]:
  with open(f"/proc/{pid}/limits") as f:
    lines = f.read().splitlines()[1:]
  return {line[:26].strip(): line[26:47].strip() for line in lines}


@pytest.fixture(scope="module")
def pool():
  with SandboxPool(max_sessions=4, limits=LIMITS) as pool:
    yield pool


@pytest.fixture
def session(pool):
  before = children()
  with pool.session(images={"img_1": scene(3)}) as s:
    yield s
  assert children() == before, "a worker outlived its session"


@pytest.fixture(scope="module")
def shared_session(pool):
  """One worker for the tests that only read its state (each starts in ~0.3 s; they add up)."""
  before = children()
  with pool.session(images={"img_1": scene(3)}) as s:
    yield s
  assert children() == before, "a worker outlived its session"


def assert_refused(result: RunResult, message: str) -> None:
  assert not result.ok, result
  assert message in result.error, result.error


# ----------------------------------------------------------------- behaviour
def test_code_sees_images_and_image_ops_and_keeps_state(session):
  first = session.run("n = count_objects(img_1, 'red')\nprint('objects:', n)")
  assert first.ok and first.stdout == "objects: 3\n" and first.value is None
  assert session.run("import image_ops\nimage_ops.count_pixels(img_1, 'red') + n").value == "15"
  assert session.run("img_1.shape, img_1.dtype").value == "((16, 40, 3), dtype('uint8'))"
  assert session.run("_[0]").value == "(16, 40, 3)"   # `_` is the last value, as in IPython


def test_an_exception_is_reported_with_its_line_and_keeps_state(session):
  result = session.run("x = 7\ny = x / 0")
  assert result == RunResult(ok=False, error="ZeroDivisionError: division by zero (line 2)",
                             cpu_s=result.cpu_s, wall_s=result.wall_s, peak_memory_mb=result.peak_memory_mb)
  assert session.run("x").value == "7"
  assert session.run("def f(:").error == "SyntaxError: invalid syntax (line 1)"


def test_files_inside_the_working_directory_work_and_are_removed(pool, tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # where the worker's directory goes
  with pool.session() as s:
    assert s.run("np.save('a.npy', np.arange(3)); open('b.txt', 'w').write('hi')").ok
    assert s.run("int(np.load('a.npy').sum()), open('b.txt').read()").value == "(3, 'hi')"
    assert sorted(os.listdir(s.work_dir)) == ["a.npy", "b.txt"]   # the host reaches them
    assert len(os.listdir(tmp_path)) == 1
  assert os.listdir(tmp_path) == []


def test_worker_runs_under_kernel_limits(shared_session):
  shared_session.run("0")
  limits = limits_of(shared_session.pid)
  assert limits["Max processes"] == "0" and limits["Max core file size"] == "0"
  assert int(limits["Max address space"]) < (256 + 400) * 2**20
  assert int(limits["Max file size"]) == LIMITS.file_mb * 2**20
  if os.geteuid() == 0:   # root ignores RLIMIT_NPROC: the worker must have dropped to nobody
    with open(f"/proc/{shared_session.pid}/status") as f:
      uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
    assert uids[0] != "0" and len(set(uids)) == 1


def test_worker_runs_under_landlock_and_seccomp_where_the_kernel_has_them(shared_session):
  shared_session.run("0")
  confinement = shared_session.confinement
  assert confinement["landlock_abi"] == sandbox_confine.landlock_abi()
  assert confinement["seccomp"] == (os.uname().machine in sandbox_confine.SYSCALLS)
  with open(f"/proc/{shared_session.pid}/status") as f:
    status = dict(line.split(":", 1) for line in f)
  assert status["NoNewPrivs"].strip() == "1"
  assert status["Seccomp"].strip() == ("2" if confinement["seccomp"] else "0")   # 2: filter mode
  assert status["CapEff"].strip() == "0" * 16 and status["State"].split()[0] == "T"   # stopped between calls
  if os.geteuid() == 0:   # root can always make namespaces: the host's file system is not the worker's
    assert confinement["mount_namespace"] and confinement["ipc_namespace"], confinement
    assert confinement["disk_quota_mb"] == LIMITS.disk_mb and not confinement["user_namespace"]
    assert os.readlink(f"/proc/{shared_session.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")


@pytest.mark.parametrize("machine", sorted(sandbox_confine.SYSCALLS))
def test_seccomp_program_sends_every_denied_call_to_eperm(machine):
  program = sandbox_confine.seccomp_program(machine)
  errno_at = len(program) - 1
  assert program[errno_at] == (sandbox_confine.BPF_RET_K, 0, 0, sandbox_confine.SECCOMP_RET_ERRNO | 1)
  assert program[errno_at - 1][3] == sandbox_confine.SECCOMP_RET_ALLOW
  jumps = {k: i + 1 + jt for i, (code, jt, jf, k) in enumerate(program[4:-2], start=4)}
  for name, number in sandbox_confine.SYSCALLS[machine].items():
    assert jumps[number] == errno_at, name


KERNEL_PROBE_SETUP = """
sys = np.__builtins__['__import__']('sys')
frame = sys._getframe()
while 'policy' not in frame.f_locals:
  frame = frame.f_back
type(frame.f_locals['policy']).__call__ = lambda self, event, args: None   # audit hook off
os, ctypes = sys.modules['os'], sys.modules['ctypes']
libc = ctypes.CDLL(None, use_errno=True)

def errno_of(call):
  try:
    call()
  except OSError as e:
    return e.errno
  return 0
"""


def test_kernel_layers_hold_when_model_code_disables_the_audit_hook(session):
  assert session.run(KERNEL_PROBE_SETUP).ok
  if not session.confinement["landlock_abi"] or not session.confinement["seccomp"]:
    pytest.skip(f"the kernel lacks Landlock or seccomp here: {session.confinement}")
  path = f"/tmp/k25jax_sandbox_escape_{uuid.uuid4().hex}"
  # the audit hook's refusals carry no errno, and it would refuse ctypes.CDLL: an errno or a
  # libc call shows the kernel answering
  assert session.run("libc.getpid() == os.getpid()").value == "True"
  # a host path is missing from the worker's mount namespace (ENOENT) or refused by Landlock
  # (EACCES; EROFS for a create in the read-only root)
  hidden = {errno.ENOENT, errno.EACCES} if session.confinement["mount_namespace"] else {errno.EACCES}
  probes = {
      "read /etc/passwd": ("errno_of(lambda: open('/etc/passwd').read())", hidden),
      "write /tmp": (f"errno_of(lambda: open('{path}', 'w').write('x'))", hidden | {errno.EROFS}),
      "list /": ("errno_of(lambda: os.listdir('/'))", {errno.EACCES}),
      "socket": ("libc.socket(2, 1, 0), ctypes.get_errno()", {(-1, 1)}),
      "fork": ("errno_of(os.fork)", {1}),
      "exec": ("errno_of(lambda: os.execv('/bin/true', ['true']))", {1}),
      "signal the host": (f"errno_of(lambda: os.kill({os.getpid()}, 0))", {1}),
  }
  for what, (code, expected) in probes.items():
    result = session.run(code)
    assert result.ok and result.value in {repr(e) for e in expected}, (what, result)
  assert not os.path.exists(path)
  assert session.run("open('inside.txt', 'w').write('ok'), open('inside.txt').read()").value == "(2, 'ok')"


# ----------------------------------------------------------------- security
def test_infinite_loop_hits_the_cpu_limit_and_the_next_call_restarts():
  before = children()
  with SandboxPool(1, Limits(cpu_s=1, wall_s=30, memory_mb=256)) as pool, pool.session() as s:
    s.run("x = 1")
    pid = s.pid
    result = s.run("while True:\n  pass")
    assert_refused(result, "cpu-time limit of 1 s per call exceeded")
    assert "next call starts a new one" in result.error
    assert s.pid is None and pid not in children()
    again = s.run("x")
    assert again.restarted and again.error == "NameError: name 'x' is not defined (line 1)"
  assert children() == before


def test_the_session_cpu_budget_is_a_kernel_limit():
  with SandboxPool(1, Limits(cpu_s=30, wall_s=30, memory_mb=256, session_cpu_s=1)) as pool, pool.session() as s:
    assert_refused(s.run("while True:\n  pass"), "cpu-time limit of 1 s per session exceeded")
    assert s.run("1").restarted


def test_sleeping_past_the_wall_time_is_killed(session):
  result = session.run("import time\ntime.sleep(60)")
  assert_refused(result, "timeout after 2 s (wall-time limit)")
  assert result.wall_s < 10 and session.run("1 + 1").value == "2"


@pytest.mark.parametrize("code, message", [
    ("import os\nwhile True:\n  os.fork()", "import of 'os' is not allowed"),
    (f"fork = {SUBCLASS_ESCAPE}['fork']\nwhile True:\n  fork()", "os.fork is not allowed"),
    (f"{ESCAPE}('os').system(':(){{ :|:& }};:')", "os.system is not allowed"),
    (f"{ESCAPE}('os').posix_spawn('/bin/sh', ['sh'], {{}})", "os.posix_spawn is not allowed"),
    (f"{ESCAPE}('subprocess')", "import of 'subprocess' is not allowed"),
])
def test_fork_bomb_is_refused_and_no_process_appears(shared_session, code, message):
  shared_session.run("0")
  assert_refused(shared_session.run(code), message)
  assert process_group(shared_session.pid) == {shared_session.pid}   # the worker alone in its group
  assert children() & process_group(shared_session.pid) == {shared_session.pid}


@pytest.mark.parametrize("code", [
    "a = np.ones(10**10 // 8)",
    "a = bytearray(10 * 2**30)",
    "a = [0] * (10**10 // 8)",
])
def test_ten_gigabyte_allocation_hits_the_memory_limit(shared_session, code):
  shared_session.run("kept = 5")
  result = shared_session.run(code)
  assert_refused(result, "memory limit of 256 MB exceeded: MemoryError")
  assert result.peak_memory_mb < 256 + 150   # the worker's resident memory stayed bounded
  assert shared_session.run("kept").value == "5"   # contained: the session goes on


@pytest.mark.parametrize("template", [
    "open('{path}', 'w').write('x')",
    "np.save('{path}', np.zeros(3))",
    f"{ESCAPE}('os').open('{{path}}', 0o101)",
    "open('../../../../../../..{path}', 'a').write('x')",
])
def test_writing_outside_the_working_directory_is_refused(shared_session, template):
  path = f"/tmp/k25jax_sandbox_escape_{uuid.uuid4().hex}"
  result = shared_session.run(template.format(path=path))
  assert_refused(result, "for writing outside the working directory is not allowed")
  assert not os.path.exists(path) and not os.path.exists(path + ".npy")


@pytest.mark.parametrize("code", [
    "open('/etc/passwd').read()",
    # numpy finds no such file in the worker's mount namespace and takes it for a URL
    "np.loadtxt('/etc/passwd', dtype=str, delimiter=':')",
    "np.fromfile('/etc/passwd', dtype=np.uint8)",
    "open('../../../../../../../etc/passwd').read()",
    f"{ESCAPE}('os').open('/etc/passwd', 0)",
    f"{ESCAPE}('os').listdir('/etc')",
    "open('../worker.log').read()",   # the host's log beside the working directory
])
def test_reading_host_files_is_refused(shared_session, code):
  result = shared_session.run(code)
  if code.startswith("np.loadtxt") and shared_session.confinement["mount_namespace"]:
    assert_refused(result, "import of 'urllib.error' is not allowed")
  else:
    assert_refused(result, "for reading outside the allowed directories is not allowed")
  assert "root:" not in result.stdout + (result.value or "")


@pytest.mark.parametrize("code, message", [
    ("import socket\nsocket.create_connection(('127.0.0.1', 80))", "import of 'socket' is not allowed"),
    (f"{ESCAPE}('socket')", "import of 'socket' is not allowed"),
    (f"{ESCAPE}('_socket')", "import of '_socket' is not allowed"),
    ("import urllib.request", "import of 'urllib.request' is not allowed"),
])
def test_network_is_refused(shared_session, code, message):
  assert_refused(shared_session.run(code), message)


@pytest.mark.parametrize("code, message", [
    ("import os", "import of 'os' is not allowed"),
    ("import sys", "import of 'sys' is not allowed"),
    ("import ctypes", "import of 'ctypes' is not allowed"),
    ("import importlib", "import of 'importlib' is not allowed"),
    ("from numpy import f2py", "import of 'numpy.f2py' is not allowed"),
    ("__import__('subprocess')", "import of 'subprocess' is not allowed"),
    ("eval(\"__import__('os')\")", "import of 'os' is not allowed"),
    ("np.ctypeslib", "import of 'numpy.ctypeslib' is not allowed"),
    (f"{ESCAPE}('ctypes').CDLL(None)", "ctypes.dlopen is not allowed"),
    pytest.param(f"{ESCAPE}('os').kill({os.getpid()}, {int(signal.SIGKILL)})", "os.kill is not allowed",
                 id="kill-the-host"),   # an id without the pid: pytest-xdist's workers collect the same names
    (f"{ESCAPE}('resource').setrlimit(9, (-1, -1))", "resource.setrlimit is not allowed"),
    ("(lambda: 0).__code__.replace(co_code=b'')", "code.__new__ is not allowed"),
])
def test_modules_off_the_allow_list_and_escapes_are_refused(shared_session, code, message):
  result = shared_session.run(code)
  assert_refused(result, message)
  assert result.blocked   # recorded even though the worker keeps going
  assert shared_session.run("1 + 1").ok


def test_a_caught_refusal_is_still_reported_in_blocked(shared_session):
  result = shared_session.run("try:\n  import os\nexcept ImportError:\n  pass\n'fine'")
  assert result.ok and result.value == "'fine'" and result.blocked == ("import of 'os'",)


def test_repeated_refusals_are_listed_up_to_a_cap(shared_session):
  result = shared_session.run("for _ in range(100):\n  try:\n    import os\n  except ImportError:\n    pass")
  assert result.ok and len(result.blocked) == 21 and result.blocked[-1] == "... and 80 more"


def test_deleting_the_restricted_builtins_does_not_open_imports(session):
  assert session.run("del __builtins__").ok
  assert_refused(session.run("import os"), "import of 'os' is not allowed")


@pytest.mark.parametrize("code, message", [
    ("print('x' * 10**7)", "output truncated at 1024 bytes"),
    ("for i in range(10**5):\n  print(i)", "output truncated at 1024 bytes"),
    ("'y' * 10**6", "value truncated at 1024 bytes"),
])
def test_huge_output_is_truncated(shared_session, code, message):
  result = shared_session.run(code)
  assert_refused(result, message)
  assert len(result.stdout.encode()) <= 1024 and len((result.value or "").encode()) <= 1024


# ----------------------------------------------------------------- pool
def test_closing_the_pool_stops_open_sessions(tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  before = children()
  pool = SandboxPool(2, LIMITS)
  s = pool.session().__enter__()
  s.run("0")
  assert pool.open_sessions == 1 and len(os.listdir(tmp_path)) == 1
  pool.close()
  assert pool.open_sessions == 0 and children() == before and os.listdir(tmp_path) == []
  with pytest.raises(RuntimeError, match="closed"):
    pool.session()


def test_a_full_pool_waits_for_a_free_slot():
  order = []

  async def episode(pool, name):
    async with pool.session():
      order.append(f"{name} in")
      await asyncio.sleep(0.05)
      order.append(f"{name} out")

  async def main():
    with SandboxPool(max_sessions=1, limits=LIMITS) as pool:
      await asyncio.gather(episode(pool, "a"), episode(pool, "b"))

  asyncio.run(main())
  assert order == ["a in", "a out", "b in", "b out"]


def test_sixty_four_concurrent_sessions_give_correct_results(tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  before = children()

  async def episode(pool, i):
    async with pool.session(images={"img_1": scene(i % 9 + 1)}) as s:
      first = await s.arun("n = count_objects(img_1, 'red')\nprint(n)")
      second = await s.arun("n * 10")   # state kept between the episode's calls
      return first, second, s.work_dir

  async def main():
    with SandboxPool(max_sessions=64, limits=Limits(wall_s=30, memory_mb=256)) as pool:
      return await asyncio.gather(*(episode(pool, i) for i in range(64)))

  results = asyncio.run(main())
  for i, (first, second, work_dir) in enumerate(results):
    assert first.ok and first.stdout == f"{i % 9 + 1}\n", (i, first)
    assert second.ok and second.value == str((i % 9 + 1) * 10), (i, second)
  assert len({work_dir for _, _, work_dir in results}) == 64   # a directory each
  assert children() == before and os.listdir(tmp_path) == []


@pytest.mark.parametrize("make, message", [
    (lambda: Limits(cpu_s=0), "Limits.cpu_s must be a positive number"),
    (lambda: Limits(output_bytes=10.5), "Limits.output_bytes must be an int"),
    (lambda: SandboxPool(0), "max_sessions must be a positive int"),
    (lambda: SandboxPool(1).session(images={"np": scene(1)}), "would hide a name"),
    (lambda: SandboxPool(1).session(images={"img 1": scene(1)}), "must be a Python identifier"),
    (lambda: SandboxPool(1).session(images={"img": np.array([object()])}), "bool/int/float array"),
])
def test_bad_arguments_name_the_field(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_a_worker_that_does_not_start_is_a_sandbox_error_and_leaves_nothing(tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # where the worker's directory goes
  before = children()
  with SandboxPool(1, Limits(start_s=0.001)) as pool, pool.session() as s:
    with pytest.raises(SandboxError, match="did not start"):
      s.run("1")
  assert children() == before and os.listdir(tmp_path) == []


def test_code_longer_than_the_limit_is_refused_before_running(shared_session):
  result = shared_session.run("#" * (MAX_CODE_BYTES + 1))
  assert not result.ok and "longer than the 1048576-byte limit" in result.error


def test_running_a_session_that_is_not_open_fails_loudly(pool):
  with pytest.raises(RuntimeError, match="not open"):
    pool.session().run("1")
