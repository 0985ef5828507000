"""Test set-up: 8 host devices so every sharding path is exercised on CPU, compiled with
cpu_env.COMPILE_FLAGS; pytest-xdist workers (pytest.ini) share one compilation cache."""
import os
import sys

# The checkout first on sys.path: config files, and tests, import `configs.common`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_env import xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# A persistent compilation cache for this test session only: tests that build their own
# jitted steps over the same configs (and the subprocesses they start) compile each
# program once. The process that starts the session makes it; its xdist workers and their
# subprocesses inherit it through the environment.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _COMPILE_CACHE = tempfile.mkdtemp(prefix="k25jax_test_jax_cache_")
  atexit.register(shutil.rmtree, _COMPILE_CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILE_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Runs several test files start from (tests/shared_runs.py), made once for the session in the same way.
if "K25JAX_TEST_SHARED_DIR" not in os.environ:
  _SHARED = tempfile.mkdtemp(prefix="k25jax_test_shared_runs_")
  atexit.register(shutil.rmtree, _SHARED, ignore_errors=True)
  os.environ["K25JAX_TEST_SHARED_DIR"] = _SHARED
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (must follow the XLA_FLAGS above)

jax.config.update("jax_default_matmul_precision", "highest")


MAX_WORKERS = 4


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: stage runs, multi-device comparisons, pod compiles: over ~10 s each on 2 "
                          "cores; CI runs them, the inner loop (-m \"not slow\") does not")


def pytest_xdist_auto_num_workers(config):
  """`-n auto`: a worker a core, at most MAX_WORKERS (each holds 8 host devices' programs)."""
  return max(1, min(os.cpu_count() or 1, MAX_WORKERS))
