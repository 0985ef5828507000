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
"""
import os
import socket

COMPILE_FLAGS = "--xla_backend_optimization_level=1"
COMPILE_BOUND_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None, compile_bound: bool = False) -> str:
  """XLA_FLAGS for a test process: `devices` host devices (None: the platform's one);
  `compile_bound`: LLVM's quickest level, for a process that mostly compiles."""
  count = "" if devices is None else f" --xla_force_host_platform_device_count={devices}"
  return (COMPILE_BOUND_FLAGS if compile_bound else COMPILE_FLAGS) + count


def subprocess_env(devices: int | None = None, compile_bound: bool = False, **extra) -> dict:
  """This process's environment for a CPU subprocess with `devices` host devices (`xla_flags`)."""
  return dict(os.environ, XLA_FLAGS=xla_flags(devices, compile_bound), JAX_PLATFORMS="cpu", **extra)


def free_port() -> int:
  """A localhost port nothing listens on now: a jax.distributed coordinator's, for processes a test starts."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]
