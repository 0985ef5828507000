"""Sharding is real: one step on 8 CPU devices equals the step on one device."""
import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k25jax.model import transformer
from k25jax.stages import pretrain
from k25jax.train import config_check, config_utils, optimizer, sharding, trainer as trainer_lib
from test_train_step import micro_config, random_batch

STEPS = 2


def train(mesh_sizes, n_devices):
  config = micro_config()
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  mesh = sharding.make_mesh(mesh_sizes, devices=jax.devices()[:n_devices])
  losses = []
  with jax.set_mesh(mesh):
    create = lambda: trainer_lib.new_state(model, tx, mesh, config.train.seed)
    step = pretrain.make_step(config, model, tx)
    state = create()
    for i in range(STEPS):
      state, metrics = step(state, sharding.global_batch(random_batch(i), sharding.batch_sharding(mesh)))
      losses.append(float(metrics["loss"]))
  return state, losses


@pytest.fixture(scope="module")
def reference():
  return train(dict(data=1), 1)


@pytest.mark.parametrize("layout", [dict(data=2, fsdp=2, expert=2), dict(fsdp=2, sequence=2, tensor=2)],
                         ids=["data2-fsdp2-expert2", "fsdp2-sequence2-tensor2"])
@pytest.mark.slow
def test_eight_devices_match_one(reference, layout):
  ref_state, ref_losses = reference
  state, losses = train(layout, 8)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5),
               state.params, ref_state.params)

  # The params and the optimizer moments are really split across devices.
  experts = state.params["layers_1"]["mlp"]["experts"]["gate_proj"]          # [E=4, d=64, f=32]
  expected = P("expert", ("fsdp", "sequence"), "tensor")                     # d over sequence too
  assert experts.sharding.spec == expected
  shard = experts.addressable_shards[0].data.shape
  d_split = layout.get("fsdp", 1) * layout.get("sequence", 1)
  assert shard == (4 // layout.get("expert", 1), 64 // d_split, 32 // layout.get("tensor", 1))
  embed = state.params["embed_tokens"]["embedding"]                          # [vocab=512, d=64]
  assert embed.addressable_shards[0].data.shape == (512 // layout.get("tensor", 1), 64 // d_split)
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.shape == experts.shape]
  assert len(moments) == 4 and all(m.sharding.is_equivalent_to(experts.sharding, 3) for m in moments)  # mu, nu of gate/up


def test_mesh_sizes():
  assert sharding.mesh_shape(dict(data=-1, tensor=2), 8) == (4, 1, 1, 1, 2)
  with pytest.raises(ValueError, match="3 devices, but 8"):
    sharding.make_mesh(dict(data=3))
  with pytest.raises(ValueError, match="do not divide the 8 devices"):
    sharding.make_mesh(dict(data=-1, fsdp=3))
  with pytest.raises(ValueError, match="unknown axes"):
    sharding.make_mesh(dict(model=8))


def test_a_mesh_over_the_first_devices():
  """`mesh.devices` = N: the axes divide the first N devices; -1 (the default), all of them."""
  mesh = sharding.make_mesh(dict(data=-1, tensor=2, devices=4))
  assert dict(mesh.shape) == dict(data=2, fsdp=1, expert=1, sequence=1, tensor=2)
  assert list(mesh.devices.flat) == jax.devices()[:4]
  assert sharding.make_mesh(dict(data=-1, devices=-1)).devices.size == 8
  assert sharding.make_mesh(dict(data=1, devices=1)).devices.size == 1
  with pytest.raises(ValueError, match="between 1 and the 8 devices"):
    sharding.make_mesh(dict(data=-1, devices=16))
  with pytest.raises(ValueError, match="needs 2 devices, but 4"):
    sharding.make_mesh(dict(data=2, devices=4))
  config = ml_collections.ConfigDict({"mesh": dict(data=-1, fsdp=1, devices=-1)})
  config_check.validate(config)                        # -1 on an axis and on `devices` at once
  config.mesh.devices = 0
  with pytest.raises(ValueError, match="mesh.devices=0"):
    config_check.validate(config)
