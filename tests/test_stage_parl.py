"""The PARL stage's config checks and its warm start (the main command end to end runs in
tests/test_notebooks.py, after parl.ipynb, whose compiled programs it loads)."""
import pytest


@pytest.mark.parametrize("field, value, message", [
    ("warm_start.delegation_share", 1.5, "warm_start.delegation_share=1.5: must be a number in [0, 1]"),
    ("warm_start.capability_share", -0.1, "warm_start.capability_share=-0.1: must be a number in [0, 1]"),
    ("warm_start.subagent_rows", -1, "warm_start.subagent_rows=-1: must be an integer >= 0"),
    ("parl.budget_range", (3, 17), "parl.budget_range=(3, 17) must be (lo, hi) with 2 <= lo <= hi <= 16"),
    ("parl.n_range", (9, 8), "parl.n_range=(9, 8) must be (lo, hi) with 1 <= lo <= hi <= 32")])
def test_bad_parl_fields_fail_naming_them(field, value, message):
  from configs import parl as parl_config
  from k25jax.stages import parl
  from k25jax.train import config_check
  config = parl_config.get_config()
  config_check.validate(config)
  parl.check(config)
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ValueError) as error:
    config_check.validate(config)
    parl.check(config)
  assert message in str(error.value)


def test_the_chat_switch_is_the_recipe_model_in_the_chat_rendering_and_checks_its_fields():
  from configs import common
  from configs import parl as parl_config
  from k25jax.stages import parl
  config = parl_config.get_config("tiny,chat")
  assert config.parl.rendering == "chat" and config.model.vocab_size == common.CHAT_VOCAB_SIZE
  assert {k: config.model[k] for k in common.TINY_CHAT_TEXT if k != "max_position_embeddings"} == {
      k: v for k, v in common.TINY_CHAT_TEXT.items() if k != "max_position_embeddings"}
  parl.check(config)
  config.model.vocab_size = 91
  with pytest.raises(ValueError, match="parl.rendering='chat' has 268 ids"):
    parl.check(config)
  config = parl_config.get_config("tiny,chat")
  config.warm_start.after_init = True
  with pytest.raises(ValueError, match="set init.checkpoint"):
    parl.check(config)
  with pytest.raises(ValueError, match="the single agent bans"):
    parl.policies(config, None, None, None, greedy=True, solo=True)


@pytest.mark.slow
def test_the_warm_start_after_init_fine_tunes_the_given_params(tmp_path):
  import jax
  import numpy as np
  from configs import parl as parl_config
  from k25jax.model import transformer
  from k25jax.stages import parl
  from k25jax.train import config_utils, sharding, trainer as trainer_lib
  config = parl_config.get_config("tiny,chat")
  config.warm_start.update(demonstrations=8, steps=2, batch=8, log_every=1, checkpoint_every=2, router_bias_rate=0.0)
  config.warm_start.optimizer.update(lr=1e-9, warmup_steps=1, decay_steps=1)
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  with jax.set_mesh(mesh):
    start = trainer_lib.fresh_params(model, mesh, seed=7)
    tuned = jax.device_get(parl.builtin_warm_start(config, model, mesh, str(tmp_path), init_params=start))
    fresh = jax.device_get(trainer_lib.fresh_params(model, mesh, seed=0))
  start = jax.device_get(start)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), tuned, start)
  assert not np.allclose(tuned["embed_tokens"]["embedding"], fresh["embed_tokens"]["embedding"])
