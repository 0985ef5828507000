"""Test set-up: 8 host devices so every sharding path is exercised on CPU."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

# The checkout first on sys.path: config files, and tests, import `configs.common`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A persistent compilation cache for this test session only: tests that build their own
# jitted steps over the same configs (and the subprocesses they start) compile each
# program once.
_COMPILE_CACHE = tempfile.mkdtemp(prefix="k25jax_test_jax_cache_")
atexit.register(shutil.rmtree, _COMPILE_CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _COMPILE_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (must follow the XLA_FLAGS above)

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end runs (still run in CI)")
