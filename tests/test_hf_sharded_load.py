"""`hf.load(path, shardings)` places every tensor on its target sharding as it streams."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from hf_fixtures import hf_logits, random_hf_model, tiny_hf_config
from k25jax.convert import hf
from k25jax.model import transformer
from k25jax.train import sharding


def test_load_places_params_on_mesh_shardings(tmp_path):
  hf_cfg = tiny_hf_config()
  model = random_hf_model(hf_cfg)
  model.save_pretrained(str(tmp_path))
  cfg = hf.load_config(str(tmp_path))
  mesh = sharding.make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
  targets = sharding.logical_to_sharding(transformer.abstract_params(cfg), mesh)
  _, params = hf.load(str(tmp_path), shardings=targets)

  flat = traverse_util.flatten_dict(params)
  flat_targets = traverse_util.flatten_dict(targets)
  for key, value in flat.items():
    assert value.sharding == flat_targets[key], key
  experts = flat[("layers_1", "mlp", "experts", "gate_proj")]
  assert experts.sharding.spec[0] == "expert"
  assert len({str(s.index) for s in experts.addressable_shards}) == 8  # expert x fsdp (embed) x tensor

  tokens = np.random.default_rng(0).integers(0, hf_cfg.vocab_size, size=(2, 16))
  logits, _ = jax.jit(transformer.Transformer(cfg).apply)({"params": params}, jnp.asarray(tokens, jnp.int32))
  np.testing.assert_allclose(np.asarray(logits), hf_logits(model, tokens), atol=1e-4, rtol=0)
