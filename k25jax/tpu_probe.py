"""Keeps libtpu quiet on hosts without TPU chips, for every `import jax` where k25jax is installed.

The dev extra installs libtpu (the TPU compiler, for compiling a pod's step from a CPU). When
jax then initialises its backends on a machine without TPU chips, libtpu's probe prints an error
block about TPU host bounds and worker hostnames. jax calls `initialize()` of every module
advertised under the `jax_plugins` entry-point group before it creates any backend
(`xla_bridge.discover_pjrt_plugins`); setup.py advertises this module there, so the hint below
is in place before libtpu reads its environment. It registers no backend.

This module must stay import-light: jax imports it while it holds its plugin lock.
"""
import glob
import os


def has_tpu_device_files() -> bool:
  """True where the host exposes TPU chips (/dev/accel* or /dev/vfio)."""
  return bool(glob.glob("/dev/accel*")) or os.path.exists("/dev/vfio")


def quiet_tpu_probe() -> None:
  """Where no TPU device file exists, tells libtpu that this host is a lone worker
  (TPU_WORKER_HOSTNAMES=localhost, TPU_HOST_BOUNDS=1,1,1), so its probe fails quietly and jax
  falls back to the CPU; a TPU host, or one where these variables are set, is left alone."""
  if not has_tpu_device_files():
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")


def initialize() -> None:
  """The `jax_plugins` hook jax calls before creating its backends."""
  quiet_tpu_probe()
