"""Logit parity with transformers' DeepseekV3ForCausalLM, and checkpoint round trips."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from hf_fixtures import hf_logits, random_hf_model, tiny_hf_config
from k25jax.convert import hf, safetensors_io
from k25jax.model import transformer

TOL = 1e-4
CONFIGS = {
    "yarn_bias_dense1": dict(),
    "grouped_dense2": dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                           first_k_dense_replace=2, num_hidden_layers=4),
    "no_q_lora_plain_rope_attn_bias": dict(q_lora_rank=None, attention_bias=True, n_shared_experts=2,
                                           rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}


def _tokens(vocab, seed=0, shape=(2, 48)):
  return np.random.default_rng(seed).integers(0, vocab, size=shape)


def _ours(path, tokens, **overrides):
  cfg, params = hf.load(path, **overrides)
  logits, _ = transformer.Transformer(cfg).apply({"params": params}, jnp.asarray(tokens, jnp.int32))
  return np.asarray(logits)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
  hf_cfg = tiny_hf_config(**CONFIGS[request.param])
  model = random_hf_model(hf_cfg)
  path = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(path)
  tokens = _tokens(hf_cfg.vocab_size)
  return path, model, tokens, hf_logits(model, tokens)


@pytest.mark.parametrize("impl", ["dense", "ragged", "ragged_dot"])
def test_logits_match_transformers(checkpoint, impl):
  path, _, tokens, ref = checkpoint
  ours = _ours(path, tokens, moe_impl=impl)
  assert np.abs(ref).max() > 0.5, "weights too small to make the comparison meaningful"
  np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_save_round_trip_loads_in_transformers(checkpoint, tmp_path):
  path, _, tokens, ref = checkpoint
  cfg, params = hf.load(path)
  hf.save(cfg, params, str(tmp_path))
  reloaded = DeepseekV3ForCausalLM.from_pretrained(str(tmp_path)).eval()
  np.testing.assert_allclose(hf_logits(reloaded, tokens), ref, atol=TOL, rtol=0)


def test_sharded_save_writes_index_and_reloads(tmp_path):
  model = random_hf_model(tiny_hf_config())
  src = tmp_path / "src"
  model.save_pretrained(str(src))
  cfg, params = hf.load(str(src))
  out = tmp_path / "sharded"
  hf.save(cfg, params, str(out), max_shard_bytes=20_000)
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 3
  tokens = _tokens(cfg.vocab_size)
  np.testing.assert_allclose(_ours(str(out), tokens), hf_logits(model, tokens), atol=TOL, rtol=0)
  reloaded = DeepseekV3ForCausalLM.from_pretrained(str(out)).eval()
  np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(model, tokens), atol=TOL, rtol=0)


def _write_state_dict(path, tensors, config):
  os.makedirs(path, exist_ok=True)
  safetensors_io.write(os.path.join(path, "model.safetensors"),
                       {k: v.detach().float().numpy() for k, v in tensors.items()})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)


def test_fused_expert_tensors_of_transformers5(tmp_path):
  hf_cfg = tiny_hf_config()
  model = random_hf_model(hf_cfg, seed=1)
  state = model.state_dict()
  assert "model.layers.1.mlp.experts.gate_up_proj" in state  # transformers 5.x in-memory layout
  _write_state_dict(tmp_path, state, hf_cfg.to_dict())
  tokens = _tokens(hf_cfg.vocab_size, seed=1)
  np.testing.assert_allclose(_ours(str(tmp_path), tokens), hf_logits(model, tokens), atol=TOL, rtol=0)


def test_k25_multimodal_prefixes_and_vision_tensors_skipped(tmp_path):
  hf_cfg = tiny_hf_config()
  model = random_hf_model(hf_cfg, seed=2)
  state = {}
  for name, value in model.state_dict().items():
    if name.startswith("model."):
      state["language_model.model." + name[len("model."):]] = value
    else:
      state["language_model." + name] = value
  state["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.zeros(6, 2)
  state["mm_projector.proj.0.weight"] = torch.zeros(2, 2)
  _write_state_dict(tmp_path, state, {"model_type": "kimi_k25", "text_config": hf_cfg.to_dict()})
  tokens = _tokens(hf_cfg.vocab_size, seed=2)
  np.testing.assert_allclose(_ours(str(tmp_path), tokens), hf_logits(model, tokens), atol=TOL, rtol=0)


def test_long_sequence_takes_the_chunked_attention_path(tmp_path):
  hf_cfg = tiny_hf_config()
  model = random_hf_model(hf_cfg, seed=4)
  model.save_pretrained(str(tmp_path))
  tokens = _tokens(hf_cfg.vocab_size, seed=4, shape=(1, 256))   # 2 query chunks of 128
  np.testing.assert_allclose(_ours(str(tmp_path), tokens), hf_logits(model, tokens), atol=TOL, rtol=0)
