"""Model configuration of the K2 text backbone, with Hugging Face field names.

`ModelConfig` holds exactly the fields of a DeepSeek-V3 / Kimi K2 `config.json`
(`text_config` of the K2.5 checkpoint) plus a few of ours that pick the compute
path (`moe_impl`, `dtype`, ...). Presets:

* ``tiny``  — the reference CPU configuration of BENCHMARKS.md (about 8.3M params).
* ``small`` — about 0.9B total parameters, for one GPU or a TPU slice.
* ``k25``   — the released Kimi K2.5 text backbone, exactly.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

MOE_IMPLS = ("dense", "ragged", "ragged_dot", "pallas")
ATTENTION_IMPLS = ("xla", "pallas", "auto")
# Fields of ours that never come from a Hugging Face config.json (whose `dtype` is torch's).
OURS = ("moe_impl", "moe_block_size", "attention_impl", "dtype", "param_dtype")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The K2 decoder's hyper-parameters (Hugging Face `DeepseekV3Config` names)."""

  vocab_size: int = 4096
  hidden_size: int = 256
  intermediate_size: int = 512
  moe_intermediate_size: int = 128
  num_hidden_layers: int = 4
  num_attention_heads: int = 8
  n_shared_experts: int = 1
  n_routed_experts: int = 16
  num_experts_per_tok: int = 4
  routed_scaling_factor: float = 2.827
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  first_k_dense_replace: int = 1
  q_lora_rank: int | None = 128
  kv_lora_rank: int = 64
  qk_nope_head_dim: int = 32
  qk_rope_head_dim: int = 16
  v_head_dim: int = 32
  hidden_act: str = "silu"
  max_position_embeddings: int = 4096
  rms_norm_eps: float = 1e-5
  rope_theta: float = 50000.0
  # None, or the DeepSeek YaRN dict: type/rope_type "yarn", factor,
  # original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim.
  rope_scaling: dict | None = None
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  initializer_range: float = 0.02
  # --- ours (not in the Hugging Face config) ---
  moe_impl: str = "ragged"          # dense | ragged | ragged_dot | pallas
  moe_block_size: int = 0           # rows per expert tile of the ragged path; 0 = auto
  attention_impl: str = "xla"       # xla | pallas | auto (Pallas when compiled for TPU/GPU, else XLA)
  dtype: str = "float32"            # activation / compute dtype
  param_dtype: str = "float32"

  def __post_init__(self):
    self.validate()

  def __hash__(self):  # hashable despite the rope_scaling dict, so it can be a static jit argument
    return hash(self.to_json())

  # ------------------------------------------------------------------ checks
  def validate(self) -> None:
    """Raises ValueError naming the first inconsistent field."""
    positive = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "max_position_embeddings")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.q_lora_rank is not None and self.q_lora_rank <= 0:
      raise ValueError(f"ModelConfig.q_lora_rank must be positive or None, got {self.q_lora_rank}")
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"ModelConfig.qk_rope_head_dim must be even (RoPE pairs), got {self.qk_rope_head_dim}")
    if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
      raise ValueError("ModelConfig.first_k_dense_replace must lie in [0, num_hidden_layers], "
                       f"got {self.first_k_dense_replace}")
    if self.num_moe_layers:
      if self.n_routed_experts <= 0:
        raise ValueError(f"ModelConfig.n_routed_experts must be positive, got {self.n_routed_experts}")
      if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
        raise ValueError(f"ModelConfig.num_experts_per_tok must lie in [1, n_routed_experts="
                         f"{self.n_routed_experts}], got {self.num_experts_per_tok}")
      if self.n_group <= 0 or self.n_routed_experts % self.n_group:
        raise ValueError(f"ModelConfig.n_group={self.n_group} must divide "
                         f"n_routed_experts={self.n_routed_experts}")
      if not 0 < self.topk_group <= self.n_group:
        raise ValueError(f"ModelConfig.topk_group must lie in [1, n_group={self.n_group}], "
                         f"got {self.topk_group}")
      per_group = self.n_routed_experts // self.n_group
      if self.n_group > 1 and per_group < 2:
        raise ValueError("ModelConfig.n_group: group scores use the top-2 experts of each group, "
                         f"so each group needs >= 2 experts (got {per_group})")
      if self.num_experts_per_tok > self.topk_group * per_group:
        raise ValueError(f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                         f"experts reachable in topk_group={self.topk_group} groups of {per_group}")
      if self.n_shared_experts < 0:
        raise ValueError(f"ModelConfig.n_shared_experts must be >= 0, got {self.n_shared_experts}")
    if self.hidden_act != "silu":
      raise ValueError(f"ModelConfig.hidden_act: only 'silu' (SwiGLU) is supported, got {self.hidden_act!r}")
    if self.moe_impl not in MOE_IMPLS:
      raise ValueError(f"ModelConfig.moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"ModelConfig.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
    if self.moe_block_size < 0:
      raise ValueError(f"ModelConfig.moe_block_size must be >= 0, got {self.moe_block_size}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"ModelConfig.{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
    if self.rope_scaling is not None:
      kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
      if kind != "yarn":
        raise ValueError(f"ModelConfig.rope_scaling: only YaRN is supported, got type {kind!r}")
      for key in ("factor", "original_max_position_embeddings"):
        if key not in self.rope_scaling:
          raise ValueError(f"ModelConfig.rope_scaling is missing {key!r}")
      if self.rope_scaling["factor"] < 1:
        raise ValueError(f"ModelConfig.rope_scaling['factor'] must be >= 1, got {self.rope_scaling['factor']}")

  # ------------------------------------------------------------- derived
  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def num_moe_layers(self) -> int:
    return self.num_hidden_layers - self.first_k_dense_replace

  def is_moe_layer(self, layer: int) -> bool:
    return layer >= self.first_k_dense_replace

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  # ------------------------------------------------------- Hugging Face I/O
  @classmethod
  def from_hf_dict(cls, hf: dict, **ours: Any) -> "ModelConfig":
    """Builds a config from a `config.json` dict (K2.5's `text_config` included).

    Understands both `rope_scaling` + `rope_theta` (the released checkpoints) and
    transformers 5.x's `rope_parameters`.
    """
    if "text_config" in hf:
      hf = hf["text_config"]
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if kind not in (None, "default"):
      scaling = {k: v for k, v in rope.items() if k != "type"}
      scaling["rope_type"] = kind
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in hf.items()
              if k in fields and k not in OURS + ("rope_scaling", "rope_theta")}
    return cls(**kwargs, rope_theta=float(theta), rope_scaling=scaling, **ours)

  def to_hf_dict(self) -> dict:
    """The `config.json` dict that transformers' `DeepseekV3Config` loads."""
    skip = OURS + ("rope_scaling", "rope_theta")
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
    rope = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling is not None:
      rope = {k: v for k, v in self.rope_scaling.items() if k != "type"}
      rope.update(rope_type="yarn", rope_theta=self.rope_theta)
    out.update(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        num_key_value_heads=self.num_attention_heads, rope_parameters=rope,
        rope_interleave=True, num_nextn_predict_layers=0, dtype=self.param_dtype,
        head_dim=self.qk_rope_head_dim)
    return out

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def _k25() -> ModelConfig:
  return ModelConfig(
      vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
      num_hidden_layers=61, num_attention_heads=64, n_shared_experts=1, n_routed_experts=384,
      num_experts_per_tok=8, routed_scaling_factor=2.827, n_group=1, topk_group=1,
      first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
      qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-5,
      rope_theta=50000.0,
      rope_scaling=dict(rope_type="yarn", factor=64.0, original_max_position_embeddings=4096,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
      dtype="bfloat16", param_dtype="bfloat16")


def _small() -> ModelConfig:
  return ModelConfig(
      vocab_size=163840, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
      num_hidden_layers=12, num_attention_heads=16, n_shared_experts=1, n_routed_experts=64,
      num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=384, kv_lora_rank=256,
      qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, max_position_embeddings=32768,
      rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=4096,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
      dtype="bfloat16", param_dtype="float32")


PRESETS = {"tiny": ModelConfig, "small": _small, "k25": _k25}


def preset(name: str, **overrides: Any) -> ModelConfig:
  """`preset("tiny" | "small" | "k25", **field_overrides)`."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
  base = PRESETS[name]()
  return base.replace(**overrides) if overrides else base


def count_params(cfg: ModelConfig) -> dict[str, int]:
  """Analytic parameter counts: total, and activated per token (top-k experts only).

  Per layer: MLA = q_a + q_a_norm + q_b (or q_proj) + kv_a + kv_a_norm + kv_b + o;
  dense FFN = 3·d·I; MoE = router (E·d + E bias) + E·3·d·I_moe + shared 3·d·(I_moe·n_shared).
  """
  d, h = cfg.hidden_size, cfg.num_attention_heads
  if cfg.q_lora_rank:
    q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
  else:
    q = d * h * cfg.qk_head_dim
  kv = (d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
        + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
  attn = q + kv + h * cfg.v_head_dim * d + 2 * d  # + the two layer norms
  dense_ffn = 3 * d * cfg.intermediate_size
  expert = 3 * d * cfg.moe_intermediate_size
  router = cfg.n_routed_experts * d + cfg.n_routed_experts
  shared = cfg.n_shared_experts * expert
  embed = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2) + d
  n_dense, n_moe = cfg.first_k_dense_replace, cfg.num_moe_layers
  total = embed + cfg.num_hidden_layers * attn + n_dense * dense_ffn + n_moe * (
      router + shared + cfg.n_routed_experts * expert)
  active = embed + cfg.num_hidden_layers * attn + n_dense * dense_ffn + n_moe * (
      router + shared + cfg.num_experts_per_tok * expert)
  return {"total": total, "active": active}


def yarn_attention_mscale(cfg: ModelConfig) -> float:
  """m = 0.1 · mscale_all_dim · ln(factor) + 1 (1 without YaRN or factor ≤ 1)."""
  s = cfg.rope_scaling
  if not s or not s.get("mscale_all_dim"):
    return 1.0
  factor = s["factor"]
  return 1.0 if factor <= 1 else 0.1 * s["mscale_all_dim"] * math.log(factor) + 1.0
