"""libtpu's probe stays quiet on a host without TPU chips, for a plain `import jax`."""
import os
import subprocess
import sys

import pytest

from k25jax import tpu_probe


def _without_tpu_hints() -> dict:
  env = dict(os.environ)
  for name in ("TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS", "JAX_PLATFORMS", "XLA_FLAGS"):
    env.pop(name, None)
  return env


@pytest.mark.skipif(tpu_probe.has_tpu_device_files(), reason="a TPU host: the probe is left alone")
def test_plain_jax_devices_prints_nothing_from_libtpu():
  """The dev extra installs libtpu; `python -c "import jax; jax.devices()"` must print nothing
  about TPUs (the jax_plugins entry point sets the lone-worker hint before backends start)."""
  out = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
                       env=_without_tpu_hints(), capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "cpu"
  assert out.stderr == "", out.stderr


def test_probe_sets_hints_only_where_unset(monkeypatch):
  monkeypatch.setattr(tpu_probe, "has_tpu_device_files", lambda: False)
  monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
  monkeypatch.setenv("TPU_HOST_BOUNDS", "2,2,1")
  tpu_probe.initialize()
  assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"
  assert os.environ["TPU_HOST_BOUNDS"] == "2,2,1"


def test_probe_leaves_a_tpu_host_alone(monkeypatch):
  monkeypatch.setattr(tpu_probe, "has_tpu_device_files", lambda: True)
  monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
  monkeypatch.delenv("TPU_HOST_BOUNDS", raising=False)
  tpu_probe.initialize()
  assert "TPU_WORKER_HOSTNAMES" not in os.environ and "TPU_HOST_BOUNDS" not in os.environ
