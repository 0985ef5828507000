"""INT4 pack-quantized experts: bit layout against compressed-tensors, error bound, checkpoint load."""
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from hf_fixtures import hf_logits, random_hf_model, tiny_hf_config
from k25jax.convert import hf, int4, safetensors_io
from k25jax.model import transformer
from k25jax.model.config import ModelConfig

ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")


def test_pack_matches_compressed_tensors_bit_for_bit():
  q = np.random.default_rng(0).integers(-8, 8, size=(5, 70)).astype(np.int8)  # 70: not a multiple of 8
  ours = int4.pack(q)
  theirs = ct.pack_to_int32(torch.from_numpy(q), 4).numpy()
  np.testing.assert_array_equal(ours, theirs)
  np.testing.assert_array_equal(int4.unpack(theirs, 70), q)


def test_dequantize_within_quantization_error():
  w = np.random.default_rng(1).normal(size=(16, 64)).astype(np.float32)
  packed, scale = int4.quantize(w, group=32)
  deq = int4.dequantize(packed, scale, w.shape, group=32)
  bound = np.repeat(scale, 32, axis=1) / 2
  assert np.all(np.abs(deq - w) <= bound + 1e-6)
  assert np.abs(deq - w).max() > 0  # it is a real quantization
  oracle = ct.unpack_from_int32(torch.from_numpy(packed), 4, torch.Size(w.shape)).numpy()
  np.testing.assert_allclose(deq, oracle * np.repeat(scale, 32, axis=1), rtol=0, atol=0)


def test_zero_point_and_bad_scale_shape():
  q = np.array([[-8, 7, 0, 1] * 8], np.int8)
  packed = int4.pack(q)
  deq = int4.dequantize(packed, np.array([[2.0]]), (1, 32), zero_point=np.array([[1.0]]), group=32)
  np.testing.assert_array_equal(deq, (q.astype(np.float32) - 1) * 2)
  with pytest.raises(ValueError, match="scale shape"):
    int4.dequantize(packed, np.ones((1, 2)), (1, 32), group=32)


def _quantize_experts(model, hf_cfg) -> dict:
  """The released layout: per-expert packed INT4 tensors. Writes the dequantized weights back into `model`."""
  f = hf_cfg.moe_intermediate_size
  projections = {"gate_proj": ("gate_up_proj", slice(0, f)), "up_proj": ("gate_up_proj", slice(f, 2 * f)),
                 "down_proj": ("down_proj", slice(None))}
  tensors = {}
  for i in range(hf_cfg.first_k_dense_replace, hf_cfg.num_hidden_layers):
    experts = model.model.layers[i].mlp.experts
    for proj, (fused, rows) in projections.items():
      weight = getattr(experts, fused)
      for e in range(hf_cfg.n_routed_experts):
        w = weight[e, rows].detach().float().numpy()
        packed, scale = int4.quantize(w)
        key = f"model.layers.{i}.mlp.experts.{e}.{proj}"
        tensors.update({key + ".weight_packed": packed, key + ".weight_scale": scale,
                        key + ".weight_shape": np.array(w.shape, np.int64)})
        with torch.no_grad():
          weight[e, rows] = torch.from_numpy(int4.dequantize(packed, scale, w.shape))
  return tensors


def test_quantized_checkpoint_loads_dequantized(tmp_path):
  """Routed experts stored pack-quantized (as released); ours equals HF with the dequantized weights."""
  hf_cfg = tiny_hf_config(hidden_size=64, moe_intermediate_size=32)
  model = random_hf_model(hf_cfg, seed=3)
  tensors = _quantize_experts(model, hf_cfg)
  tensors.update({name: value.float().numpy() for name, value in model.state_dict().items()
                  if ".mlp.experts." not in name})
  safetensors_io.write(str(tmp_path / "model.safetensors"), tensors)
  config = hf_cfg.to_dict()
  config["quantization_config"] = {"format": "pack-quantized", "quant_method": "compressed-tensors",
                                   "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32,
                                                                             "symmetric": True}}}}
  (tmp_path / "config.json").write_text(json.dumps(config))
  tokens = np.random.default_rng(3).integers(0, hf_cfg.vocab_size, size=(2, 24))
  cfg, params = hf.load(str(tmp_path))
  ours, _ = transformer.Transformer(cfg).apply({"params": params}, jnp.asarray(tokens, jnp.int32))
  np.testing.assert_allclose(np.asarray(ours), hf_logits(model, tokens), atol=1e-4, rtol=0)


def test_export_writes_the_routed_experts_as_released_and_loads_them_back(tmp_path):
  """hf.save(int4_group=32): every routed expert as weight_packed / bfloat16 weight_scale /
  weight_shape that compressed-tensors unpacks to our q, within half a step of the weight
  (the bfloat16 scale's rounding aside); the rest untouched; hf.load gives the dequantized experts."""
  cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                    q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                    max_position_embeddings=64)
  params = jax.device_get(transformer.init_params(cfg, jax.random.PRNGKey(0)))
  hf.save(cfg, params, str(tmp_path), int4_group=32)
  file = safetensors_io.SafetensorsFile(str(tmp_path / "model.safetensors"))
  stored = {name: file.get(name) for name in file.keys()}
  dense = dict(hf.to_hf_tensors(cfg, params))
  experts = [n for n in dense if ".mlp.experts." in n]
  assert len(experts) == 3 * cfg.n_routed_experts * (cfg.num_hidden_layers - cfg.first_k_dense_replace)
  for name, w in dense.items():
    if name not in experts:
      np.testing.assert_array_equal(stored[name], w)
      continue
    stem = name[:-len("weight")]
    assert name not in stored and stored[stem + "weight_scale"].dtype == ml_dtypes.bfloat16
    packed, scale = stored[stem + "weight_packed"], stored[stem + "weight_scale"].astype(np.float32)
    np.testing.assert_array_equal(stored[stem + "weight_shape"], w.shape)
    q = ct.unpack_from_int32(torch.from_numpy(packed.copy()), 4, torch.Size(w.shape)).numpy()
    deq = q * np.repeat(scale, 32, axis=1)
    assert np.all(np.abs(deq - w) <= 0.55 * np.repeat(scale, 32, axis=1) + 1e-7)
    np.testing.assert_array_equal(int4.dequantize(packed, scale, w.shape), deq)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["quantization_config"]["format"] == "pack-quantized"
  assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
  loaded_cfg, loaded = hf.load(str(tmp_path))
  back = dict(hf.to_hf_tensors(loaded_cfg, jax.device_get(loaded)))
  for name in experts:
    stem = name[:-len("weight")]
    np.testing.assert_array_equal(back[name], int4.dequantize(stored[stem + "weight_packed"],
                                                               stored[stem + "weight_scale"], dense[name].shape))
  np.testing.assert_array_equal(back["lm_head.weight"], dense["lm_head.weight"])
