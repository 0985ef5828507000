"""The XLA:CPU set-up of the tests and of the processes they start.

`COMPILE_FLAGS`: LLVM at optimisation level 1 instead of 2. Most of a tiny test is XLA
compilation, and the backend's LLVM passes are a large part of it: the five stages of
tests/test_stage_multiprocess.py in one process took 208 CPU-s at the default level and
164 at level 1, while a 250-step warm start ran no slower (32 against 36 CPU-s; level 0
compiled faster still, 136, but ran that warm start at 52). The level changes how the
host code is scheduled, not what it computes: XLA's own passes (fusion, SPMD partitioning,
collectives) run as they do for users, and LLVM keeps IEEE float semantics at every level.

`COMPILE_BOUND_FLAGS`: level 0, for processes that compile many programs and run each a
step or two (the two-process comparison's workers): its five stages in one 4-device process
took 137 CPU-s at level 0 against 185 at level 1.

`compile_once_for_both_processes`: in a test's pair of jax.distributed processes, process 0
compiles each program and hands the executable to process 1 (jax's share_binary_between_hosts).
"""
import os
import socket

COMPILE_FLAGS = "--xla_backend_optimization_level=1"
COMPILE_BOUND_FLAGS = "--xla_backend_optimization_level=0"
SHARE_TIMEOUT_MS = 5 * 60 * 1000


def xla_flags(devices: int | None = None, compile_bound: bool = False) -> str:
  """XLA_FLAGS for a test process: `devices` host devices (None: the platform's one);
  `compile_bound`: LLVM's quickest level, for a process that mostly compiles."""
  count = "" if devices is None else f" --xla_force_host_platform_device_count={devices}"
  return (COMPILE_BOUND_FLAGS if compile_bound else COMPILE_FLAGS) + count


def subprocess_env(devices: int | None = None, compile_bound: bool = False, **extra) -> dict:
  """This process's environment for a CPU subprocess with `devices` host devices (`xla_flags`)."""
  return dict(os.environ, XLA_FLAGS=xla_flags(devices, compile_bound), JAX_PLATFORMS="cpu", **extra)


def compile_once_for_both_processes() -> None:
  """Process 1 of a pair takes each program process 0 compiled, instead of compiling it too; call
  before jax.distributed.initialize.

  jax shares a program between processes (`jax_share_binary_between_hosts`: process 0 compiles and
  posts the executable in the coordinator's key-value store, the others wait for it) under its
  compilation-cache key. On CPU that key hashes the topology of the devices, and a process's CPU
  topology names its own devices, so the pair's keys for one program differ and process 1 would
  wait for a key process 0 never posts. Here the devices are hashed by kind, as jax does for a
  backend without a topology; the key still holds the program, the compile options with the device
  assignment, the XLA flags and the versions. If this jax lacks those hooks, both processes compile.
  """
  import jax
  from jax._src import cache_key
  if not (callable(getattr(cache_key, "_hash_accelerator_config", None))
          and callable(getattr(cache_key, "_hash_devices", None))):
    return
  cache_key._hash_accelerator_config = cache_key._hash_devices     # pylint: disable=protected-access
  jax.config.update("jax_share_binary_between_hosts", True)
  # jax's default wait is 20 minutes; a program compiles here in well under one, so a process 0
  # that died fails its partner within SHARE_TIMEOUT_MS instead.
  jax.config.update("jax_share_binary_between_hosts_timeout_ms", SHARE_TIMEOUT_MS)


def free_port() -> int:
  """A localhost port nothing listens on now: a jax.distributed coordinator's, for processes a test starts."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]
