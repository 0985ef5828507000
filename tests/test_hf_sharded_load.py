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


def test_each_device_reads_only_its_experts_and_the_scanned_layout_loads_alike(tmp_path, monkeypatch):
  """Experts sharded 8 ways: every routed expert tensor is read once (by the device that holds
  it), never a whole stacked leaf; the scanned layout (`scan_layers`) reads them the same way
  and gives the same logits."""
  from k25jax.convert import safetensors_io
  hf_cfg = tiny_hf_config()
  model = random_hf_model(hf_cfg)
  model.save_pretrained(str(tmp_path), save_original_format=True)
  reads = {}
  get = safetensors_io.SafetensorsFile.get

  def counted(self, name):
    reads[name] = reads.get(name, 0) + 1
    return get(self, name)
  monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", counted)
  tokens = np.random.default_rng(0).integers(0, hf_cfg.vocab_size, size=(2, 16))
  for scan_layers in (False, True):
    reads.clear()
    cfg = hf.load_config(str(tmp_path), scan_layers=scan_layers)
    mesh = sharding.make_mesh({"expert": 8})
    targets = sharding.logical_to_sharding(transformer.abstract_params(cfg), mesh)
    _, params = hf.load(str(tmp_path), shardings=targets, scan_layers=scan_layers)
    experts = {name: n for name, n in reads.items() if ".mlp.experts." in name}
    assert len(experts) == 3 * 8 * (hf_cfg.num_hidden_layers - 1) and set(experts.values()) == {1}, experts
    logits, _ = jax.jit(transformer.Transformer(cfg).apply)({"params": params}, jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), hf_logits(model, tokens), atol=1e-4, rtol=0)
