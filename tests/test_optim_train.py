"""`optimizer.name='muonclip'` in the pretrain stage: Muon update, then QK-Clip, on 8 devices."""
import jax
import numpy as np
import pytest

from k25jax.model import transformer
from k25jax.stages import pretrain
from k25jax.train import config_utils, optimizer, sharding, trainer as trainer_lib
from test_train_step import micro_config, random_batch

TAU = 1e-3   # below every head's logit at initialisation: every head is clipped


@pytest.mark.slow
def test_muonclip_step_clips_every_head_and_logs_it():
  config = micro_config()
  config.optimizer.update(name="muonclip", qk_clip_tau=TAU)
  cfg = config_utils.model_config_from(config.model)
  model = transformer.Transformer(cfg)
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
  with jax.set_mesh(mesh):
    create = lambda: trainer_lib.new_state(model, tx, mesh, config.train.seed)
    step = pretrain.make_step(config, model, tx)
    state = create()
    history = []
    for i in range(2):
      state, metrics = step(state, sharding.global_batch(random_batch(i), sharding.batch_sharding(mesh)))
      history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
  first, second = history
  assert first["qk_clip/clipped_heads"] == cfg.num_hidden_layers * cfg.num_attention_heads
  assert first["qk_clip/max_logit"] == first["max_attention_logit"] > 10 * TAU
  assert max(first[f"qk_clip/max_logit_layer_{i}"] for i in range(cfg.num_hidden_layers)) == first["qk_clip/max_logit"]
  # Every head was clipped to τ: the next step's logits are back near τ (plus one update's growth).
  assert second["max_attention_logit"] < 2 * TAU
  assert np.isfinite(second["loss"]) and second["finite"] == 1.0


def test_adamw_step_has_no_qk_clip():
  config = micro_config()
  assert optimizer.qk_clip_tau(config.optimizer) is None
  config.optimizer.name = "muonclip"
  assert optimizer.qk_clip_tau(config.optimizer) == 100.0
