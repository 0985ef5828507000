"""The jitted train step: non-finite guard, router-bias update, optimizer masking, schedule."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k25jax.model import moe, transformer
from configs import common
from k25jax.stages import pretrain
from k25jax.train import config_utils, optimizer, sharding, trainer as trainer_lib

MICRO = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
             q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def load_pretrain_config(preset):
  return config_utils.load_config_file(os.path.join(os.path.dirname(__file__), "..", "configs", "pretrain.py"), preset)


def micro_config():
  config = load_pretrain_config("tiny")
  config.model = common.model_section("tiny", **MICRO)
  config.train.update(steps=10, batch=8, seq_len=16, router_bias_rate=0.01)
  config.optimizer.update(warmup_steps=1, decay_steps=2)
  return config


def random_batch(seed=0, batch=8, seq=16, vocab=512):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, size=(batch, seq + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy(),
          "segment_ids": np.ones((batch, seq), np.int32), "loss_mask": np.ones((batch, seq), np.float32)}


@pytest.fixture(scope="module")
def setup():
  config = micro_config()
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  mesh = sharding.make_mesh(dict(data=1), devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    create = lambda: trainer_lib.new_state(model, tx, mesh, config.train.seed)
    step = pretrain.make_step(config, model, tx)
  return config, model, mesh, create, step


@pytest.mark.slow
def test_non_finite_gradient_skips_the_update(setup):
  _, _, mesh, create, step = setup
  bad = random_batch()
  bad["loss_mask"][0, 0] = np.nan
  with jax.set_mesh(mesh):
    state = create()
    before = jax.device_get((state.params, state.opt_state))
    state, metrics = step(state, bad)
    after = jax.device_get((state.params, state.opt_state))
    assert int(state.step) == 1 and int(state.skipped) == 1
    assert float(metrics["finite"]) == 0.0 and float(metrics["skipped_steps"]) == 1.0
    jax.tree.map(np.testing.assert_array_equal, after, before)
    state, metrics = step(state, random_batch(1))
  assert float(metrics["finite"]) == 1.0 and int(state.skipped) == 1
  moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), state.params, before[0])
  assert max(jax.tree.leaves(moved)) > 0


@pytest.mark.slow
def test_router_bias_follows_the_load_not_the_optimizer(setup):
  config, model, mesh, create, step = setup
  batch = random_batch(2)
  with jax.set_mesh(mesh):
    state = create()
    params = jax.device_get(state.params)
    _, aux = model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"])
    state, _ = step(state, batch)
  load = np.asarray(aux["expert_load"][0])
  bias = params["layers_1"]["mlp"]["gate"][moe.ROUTER_BIAS]
  expected = bias + config.train.router_bias_rate * np.sign(load.mean() - load)
  got = np.asarray(state.params["layers_1"]["mlp"]["gate"][moe.ROUTER_BIAS])
  assert load.std() > 0   # an unbalanced load, so the update is not trivially zero
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-7)


def test_optimizer_freezes_router_bias_and_decays_only_matrices():
  config = micro_config()
  config.optimizer.update(weight_decay=0.5, warmup_steps=0)
  tx = optimizer.make_optimizer(config.optimizer, 10)
  params = {"layers_1": {"mlp": {"gate": {moe.ROUTER_BIAS: jnp.ones(4), "kernel": jnp.ones((3, 4))}}},
            "norm": {"weight": jnp.ones(3)}}
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero_grads, tx.init(params), params)
  gate = updates["layers_1"]["mlp"]["gate"]
  assert float(jnp.abs(gate[moe.ROUTER_BIAS]).max()) == 0.0       # frozen
  assert float(jnp.abs(updates["norm"]["weight"]).max()) == 0.0    # no decay on vectors
  np.testing.assert_allclose(gate["kernel"], -config.optimizer.lr * 0.5, rtol=1e-6)


def test_wsd_schedule_shape():
  sched = optimizer.wsd_schedule(1.0, total_steps=100, warmup_steps=10, decay_steps=20, final_lr_ratio=0.1)
  np.testing.assert_allclose([sched(0), sched(5), sched(10), sched(79), sched(80), sched(90), sched(100)],
                             [0.0, 0.5, 1.0, 1.0, 1.0, 0.55, 0.1], atol=1e-6)
  with pytest.raises(ValueError, match="decay_steps"):
    optimizer.wsd_schedule(1.0, total_steps=10, warmup_steps=5, decay_steps=6, final_lr_ratio=0.1)
