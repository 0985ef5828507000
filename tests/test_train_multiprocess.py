"""Two processes (jax.distributed over localhost, gloo CPU collectives, 2 devices each)
run the same train steps as one process with 4 devices, with the same result.

Run as a script, this file is one of the two worker processes.
"""
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from cpu_env import subprocess_env
from jax.experimental import multihost_utils

from k25jax.model import transformer
from k25jax.stages import pretrain
from k25jax.train import config_utils, optimizer, sharding, trainer as trainer_lib
from test_train_step import micro_config, random_batch

MESH = dict(data=2, fsdp=2)
STEPS = 2


def train(devices):
  """STEPS steps on the same global batches whatever the number of processes."""
  config = micro_config()
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  mesh = sharding.make_mesh(MESH, devices=devices)
  losses = []
  with jax.set_mesh(mesh):
    create = lambda: trainer_lib.new_state(model, tx, mesh, config.train.seed)
    step = pretrain.make_step(config, model, tx)
    state = create()
    for i in range(STEPS):
      rows = random_batch(i)
      batch = {k: jax.make_array_from_callback(v.shape, sharding.batch_sharding(mesh), lambda idx, v=v: v[idx])
               for k, v in rows.items()}
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
  return multihost_utils.process_allgather(state.params, tiled=True), losses


def flat(params):
  return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = subprocess_env(2)
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
  workers = [subprocess.Popen([sys.executable, __file__, str(i), str(port), str(tmp_path / f"out{i}.npz")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
  outputs = [w.communicate(timeout=240)[0] for w in workers]
  for w, out in zip(workers, outputs):
    assert w.returncode == 0, out[-3000:]
  params, losses = train(jax.devices()[:4])
  for i in range(2):
    got = np.load(tmp_path / f"out{i}.npz")
    np.testing.assert_allclose(got["__losses__"], losses, rtol=1e-5)
    for name, value in flat(params).items():
      np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=2e-5, err_msg=name)


if __name__ == "__main__":
  process_id, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
  jax.config.update("jax_default_matmul_precision", "highest")
  jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
  assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())
  gathered, step_losses = train(jax.devices())
  np.savez(out, __losses__=np.asarray(step_losses), **flat(gathered))
