"""A checkpoint that disagrees with its config fails naming the tensor."""
import json

import numpy as np
import pytest

from hf_fixtures import random_hf_model, tiny_hf_config
from k25jax.convert import hf, safetensors_io


@pytest.fixture(scope="module")
def state():
  hf_cfg = tiny_hf_config()
  model = random_hf_model(hf_cfg)
  tensors = {}
  for name, value in model.state_dict().items():
    tensors[name] = value.float().numpy()
  return hf_cfg.to_dict(), tensors


def _write(path, config, tensors):
  safetensors_io.write(str(path / "model.safetensors"), tensors)
  (path / "config.json").write_text(json.dumps(config))


def test_wrong_shape_names_tensor(tmp_path, state):
  config, tensors = dict(state[0]), dict(state[1])
  tensors["model.layers.0.self_attn.kv_b_proj.weight"] = np.zeros((3, 8), np.float32)
  _write(tmp_path, config, tensors)
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.0\.self_attn\.kv_b_proj\.weight"):
    hf.load(str(tmp_path))


def test_config_disagreeing_with_weights_names_tensor(tmp_path, state):
  config, tensors = dict(state[0]), state[1]
  config["hidden_size"] = 40
  _write(tmp_path, config, tensors)
  with pytest.raises(hf.CheckpointError, match=r"tensor '(lm_head|model\.[\w.]+)\.weight' has shape"):
    hf.load(str(tmp_path))


def test_missing_tensor_is_named(tmp_path, state):
  config, tensors = state[0], dict(state[1])
  del tensors["model.layers.2.post_attention_layernorm.weight"]
  _write(tmp_path, config, tensors)
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.2\.post_attention_layernorm\.weight"):
    hf.load(str(tmp_path))


def test_unknown_tensor_is_named(tmp_path, state):
  config, tensors = state[0], dict(state[1])
  tensors["model.layers.1.mlp.mystery.weight"] = np.zeros((2, 2), np.float32)
  _write(tmp_path, config, tensors)
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.1\.mlp\.mystery\.weight"):
    hf.load(str(tmp_path))


def test_truncated_file_is_named(tmp_path, state):
  config, tensors = state
  _write(tmp_path, config, tensors)
  path = tmp_path / "model.safetensors"
  path.write_bytes(path.read_bytes()[:-64])
  with pytest.raises(ValueError, match="truncated: tensor .* ends at byte"):
    hf.load(str(tmp_path))
