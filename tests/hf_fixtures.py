"""Tiny random `DeepseekV3ForCausalLM` checkpoints for parity tests."""
from __future__ import annotations

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

YARN = dict(rope_type="yarn", rope_theta=50000.0, factor=4.0, original_max_position_embeddings=64,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def tiny_hf_config(**overrides) -> DeepseekV3Config:
  fields = dict(
      vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
      num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
      kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
      max_position_embeddings=256, rms_norm_eps=1e-5, routed_scaling_factor=2.827,
      rope_parameters=dict(YARN), num_nextn_predict_layers=0)
  fields.update(overrides)
  if "num_attention_heads" in overrides:
    fields["num_key_value_heads"] = overrides["num_attention_heads"]
  return DeepseekV3Config(**fields)


def random_hf_model(hf_config: DeepseekV3Config, seed: int = 0, std: float = 0.25,
                    bias_std: float = 0.1) -> DeepseekV3ForCausalLM:
  """Random weights large enough that routing and attention are far from uniform."""
  torch.manual_seed(seed)
  model = DeepseekV3ForCausalLM(hf_config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, std)
    for layer in model.model.layers[hf_config.first_k_dense_replace:]:
      layer.mlp.gate.e_score_correction_bias.normal_(0.0, bias_std)
  return model


def hf_logits(model: DeepseekV3ForCausalLM, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
