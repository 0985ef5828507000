"""FP8 checkpoints in the released layout (DeepSeek-V3, Kimi-K2): e4m3 weights with 128x128
`weight_scale_inv` blocks, dequantized on load, against transformers on the same weights
dequantized by torch; multi-token-prediction layers skipped with one line."""
import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hf_fixtures import fp8_quantize, fp8_tensors, hf_logits, random_hf_model, save_fp8_folder, tiny_hf_config
from k25jax.convert import hf, safetensors_io
from k25jax.convert.common import CheckpointError
from k25jax.model import transformer


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
  """A tiny DeepseekV3 (hidden 160: full and partial blocks) in the FP8 layout with one MTP
  layer; the transformers model with the same weights dequantized by torch."""
  hf_cfg = tiny_hf_config(hidden_size=160, intermediate_size=200, moe_intermediate_size=136, q_lora_rank=144,
                          num_nextn_predict_layers=1)
  model = random_hf_model(hf_cfg)
  tensors, reference, fused = fp8_tensors(model)
  mtp = hf_cfg.num_hidden_layers           # the MTP layer's tensors, as the released folders hold them
  q, blocks = fp8_quantize(torch.randn(hf_cfg.hidden_size, 2 * hf_cfg.hidden_size))
  tensors.update({f"model.layers.{mtp}.eh_proj.weight": q, f"model.layers.{mtp}.eh_proj.weight_scale_inv": blocks,
                  f"model.layers.{mtp}.enorm.weight": torch.ones(hf_cfg.hidden_size)})
  path = save_fp8_folder(tensors, hf_cfg, str(tmp_path_factory.mktemp("fp8")))
  model.load_state_dict(fused)
  return path, model, reference, tensors


def test_fp8_weights_load_dequantized_and_match_transformers(fp8_checkpoint, tmp_path, caplog):
  path, model, reference, tensors = fp8_checkpoint
  assert sum(t.dtype == torch.float8_e4m3fn for t in tensors.values()) == 73   # attention 3 x 5, dense MLP 3, experts 2 x 8 x 3, shared 2 x 3, MTP 1
  caplog.set_level(logging.INFO)
  cfg, params = hf.load(path)
  assert [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()] == [
      f"{path}: skipped layers [3]: multi-token-prediction layers (num_nextn_predict_layers=1), which k25jax does "
      "not train"]
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 40))
  ours, _ = transformer.Transformer(cfg).apply({"params": params}, jnp.asarray(tokens, jnp.int32))
  ref = hf_logits(model, tokens)
  assert np.abs(ref).max() > 0.5
  np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)
  hf.save(cfg, params, str(tmp_path))          # every weight equals torch's dequantization, bit for bit
  saved = {name: np.asarray(file.get(name)) for name, file in safetensors_io.iterate(str(tmp_path))}
  assert sorted(saved) == sorted(reference), set(saved) ^ set(reference)
  for name, value in reference.items():
    np.testing.assert_array_equal(saved[name], value.numpy(), err_msg=name)


def _rewrite(src, dst, drop=(), replace=None, config=None):
  os.makedirs(dst, exist_ok=True)
  from safetensors.torch import load_file
  tensors = {k: v for k, v in load_file(os.path.join(src, "model.safetensors")).items() if k not in drop}
  tensors.update(replace or {})
  save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(src, "config.json")) as f:
    hf_config = json.load(f)
  hf_config.update(config or {})
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump({k: v for k, v in hf_config.items() if v is not None}, f)
  return dst


def test_bad_fp8_folders_fail_naming_the_tensor(fp8_checkpoint, tmp_path):
  path = fp8_checkpoint[0]
  name = "model.layers.0.self_attn.q_a_proj.weight"
  bad = _rewrite(path, str(tmp_path / "no_scale"), drop=(name + "_scale_inv",))
  with pytest.raises(CheckpointError, match=rf"tensor '{name}' \(FP8\) has no weight_scale_inv beside it"):
    hf.load(bad)
  bad = _rewrite(path, str(tmp_path / "bad_scale"), replace={name + "_scale_inv": torch.ones(1, 1)})
  with pytest.raises(CheckpointError, match=r"weight_scale_inv has shape \(1, 1\); a \(144, 160\) weight in 128x128 "
                                            r"blocks needs \(2, 2\)"):
    hf.load(bad)
  bad = _rewrite(path, str(tmp_path / "no_config"), config={"quantization_config": None})
  with pytest.raises(CheckpointError, match="quant_method 'fp8'"):
    hf.load(bad)
