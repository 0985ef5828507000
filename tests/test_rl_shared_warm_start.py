"""rl.shared_warm_start: one SFT warm start per (model, task, warm_start) sections, trained once."""
import concurrent.futures
import fcntl
import os

import pytest
from config_files import load_config
from k25jax.stages import rl


def _config():
  config = load_config("configs/rl.py")
  config.warm_start.update(dict(steps=3, batch=8, demonstrations=64, log_every=3, checkpoint_every=3))
  config.warm_start.optimizer.update(dict(warmup_steps=1, decay_steps=1))
  config.model.num_hidden_layers = 1          # what is cached matters here, not the model
  return config


def test_the_key_follows_the_warm_start_not_the_rl_settings():
  rl_changed, warm_changed = _config(), _config()
  rl_changed.loss.name, rl_changed.toggle.enabled, rl_changed.train.steps = "cispo", True, 7
  warm_changed.warm_start.seed = 1
  assert rl.warm_start_key(rl_changed) == rl.warm_start_key(_config()) != rl.warm_start_key(warm_changed)


@pytest.mark.slow
def test_the_warm_start_is_trained_once_and_then_reused(tmp_path):
  root = str(tmp_path)
  first = rl.shared_warm_start(_config(), root)
  saved = os.path.join(first, "checkpoints")
  stamp = os.path.getmtime(saved)
  other = _config()
  other.loss.name = "cispo"
  assert rl.shared_warm_start(other, root) == first == os.path.join(root, rl.warm_start_key(other), "warm_start")
  assert os.listdir(saved) == ["3"] and os.path.getmtime(saved) == stamp      # not trained again
  given = _config()
  given.init.checkpoint = "/somewhere/warm_start"
  assert rl.shared_warm_start(given, root) == "/somewhere/warm_start"

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    with open(os.path.join(root, rl.warm_start_key(other), ".lock"), "w") as held:
      fcntl.flock(held, fcntl.LOCK_EX)               # as if another process were training it
      waiting = pool.submit(rl.shared_warm_start, other, root)
      concurrent.futures.wait([waiting], timeout=3)
      assert not waiting.done()
    assert waiting.result(timeout=600) == first
