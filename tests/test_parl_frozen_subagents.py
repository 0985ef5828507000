"""parl.frozen_subagents: the params a finished run's sub-agents were frozen at, restored."""
import os

import jax
import numpy as np
import optax
from config_files import load_config
from flax import traverse_util

from k25jax.model import transformer
from k25jax.stages import parl
from k25jax.train import checkpoint, config_utils
from k25jax.train import state as state_lib


def _config():
  config = load_config("configs/parl.py")
  config.model.num_hidden_layers = 1       # what is restored matters here, not the model
  return config


def _save(path, seed):
  """A checkpoint of a fresh state (as the warm start writes it) under path/checkpoints; returns its params."""
  config = _config()
  params = transformer.init_params(config_utils.model_config_from(config.model), jax.random.PRNGKey(seed))
  saver = checkpoint.Checkpoints(path, keep=1)
  saver.save(1, state_lib.create(params, optax.sgd(0.1), jax.random.PRNGKey(0)))
  saver.close()
  return params


def _assert_same(a, b):
  flat_a, flat_b = traverse_util.flatten_dict(a), traverse_util.flatten_dict(b)
  assert flat_a.keys() == flat_b.keys()
  for key in flat_a:
    np.testing.assert_array_equal(np.asarray(flat_a[key]), np.asarray(flat_b[key]))


def test_the_warm_start_the_run_trained_unless_a_subagent_checkpoint_is_set(tmp_path):
  workdir = str(tmp_path / "run")
  warm = _save(os.path.join(workdir, "warm_start"), seed=1)
  config = _config()
  _assert_same(parl.frozen_subagents(config, workdir), warm)
  config.parl.subagent_checkpoint = str(tmp_path / "subagents")
  frozen = _save(config.parl.subagent_checkpoint, seed=2)
  _assert_same(parl.frozen_subagents(config, workdir), frozen)
