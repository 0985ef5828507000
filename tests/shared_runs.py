"""Runs that tests in several files share, trained once per test session whichever xdist
worker asks first (the others wait on `rl.shared_warm_start`'s file lock, then read it).

They live under $K25JAX_TEST_SHARED_DIR, which tests/conftest.py makes for the session.
"""
import os

from config_files import load_config


def shared_dir() -> str:
  return os.environ["K25JAX_TEST_SHARED_DIR"]


def compact_toggle_rl_config():
  """configs/rl.py:tiny,toggle,compact with a warm start that answers some prompts right
  (held-out sampled accuracy ~0.25, so groups get different rewards), 64 training prompts."""
  config = load_config("configs/rl.py", "tiny,toggle,compact")
  config.warm_start.update(demonstrations=4096, steps=250, batch=64, log_every=250, checkpoint_every=250)
  config.warm_start.optimizer.update(warmup_steps=10, decay_steps=50)
  config.task.update(train_prompts=64, eval_prompts=8)
  return config


def compact_toggle_warm_start() -> str:
  """The workdir of `compact_toggle_rl_config`'s built-in warm start (its `init.checkpoint`)."""
  from k25jax.stages import rl
  config = compact_toggle_rl_config()
  config.mesh.update(data=-1, fsdp=1)
  return rl.shared_warm_start(config, os.path.join(shared_dir(), "rl_warm_starts"))
