"""Tiny random `DeepseekV3ForCausalLM` checkpoints for parity tests, in transformers' layout or
in the released FP8 one (DeepSeek-V3, Kimi-K2)."""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import save_file
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


FP8_BLOCK = 128
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  """(e4m3 weight, float32 scale per 128x128 block): scale = the block's max |w| / 448."""
  rows, cols = w.shape
  blocks = torch.zeros(-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
  for i in range(blocks.shape[0]):
    for j in range(blocks.shape[1]):
      block = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
      blocks[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
  return (w / _per_element(blocks, rows, cols)).to(torch.float8_e4m3fn), blocks


def fp8_dequantize(q: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
  return q.to(torch.float32) * _per_element(blocks, *q.shape)


def _per_element(blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
  return blocks.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]


def fp8_layer_weight(name: str, tensor: torch.Tensor) -> bool:
  """The tensors the released checkpoints store in FP8: the linear weights of the layers, not
  the norms, the router, the embeddings or the head."""
  return name.startswith("model.layers.") and tensor.ndim == 2 and not name.endswith("mlp.gate.weight")


def fp8_tensors(model: DeepseekV3ForCausalLM) -> tuple[dict, dict, dict]:
  """`model`'s weights as the released FP8 files hold them: (the tensors to write, one per expert
  and an `_scale_inv` beside each e4m3 weight; each written weight as torch dequantizes it, by
  the file's names; transformers' state dict of the dequantized weights, experts fused)."""
  tensors, dequantized, fused = {}, {}, {}

  def add(name, value):
    q, blocks = fp8_quantize(value.float())
    tensors[name], tensors[name + "_scale_inv"] = q, blocks
    dequantized[name] = fp8_dequantize(q, blocks)
    return dequantized[name]

  for name, value in model.state_dict().items():
    prefix, _, leaf = name.rpartition(".experts.")
    if leaf == "gate_up_proj":      # transformers fuses the experts; the released files hold one per expert
      f = value.shape[1] // 2
      fused[name] = torch.stack([torch.cat([add(f"{prefix}.experts.{e}.gate_proj.weight", w[:f]),
                                            add(f"{prefix}.experts.{e}.up_proj.weight", w[f:])])
                                 for e, w in enumerate(value)])
    elif leaf == "down_proj":
      fused[name] = torch.stack([add(f"{prefix}.experts.{e}.down_proj.weight", w) for e, w in enumerate(value)])
    elif fp8_layer_weight(name, value):
      fused[name] = add(name, value)
    else:
      tensors[name] = dequantized[name] = fused[name] = value.float().contiguous()
  return tensors, dequantized, fused


def save_fp8_folder(tensors: dict, hf_config: DeepseekV3Config, path: str) -> str:
  """`tensors` as model.safetensors and `hf_config` with the released `quantization_config`."""
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({**hf_config.to_dict(), "quantization_config": FP8_CONFIG}, f)
  return path
