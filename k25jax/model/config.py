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
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
EP_DISPATCHES = ("auto", "all_to_all", "ragged_all_to_all")
# Fields of ours that never come from a Hugging Face config.json (whose `dtype` is torch's).
OURS = ("moe_impl", "moe_block_size", "attention_impl", "dtype", "param_dtype", "scan_layers",
        "remat_policy", "expert_parallel", "ep_dispatch", "ep_capacity_factor")
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
  scan_layers: bool = False         # nn.scan over the MoE layers: params under "moe_layers", [layers, ...]
  remat_policy: str = "none"        # none | full | dots | dots_no_batch: what backward keeps per layer
  expert_parallel: bool = True      # routed experts by all-to-all over the mesh's `expert` axis (if > 1 device)
  ep_dispatch: str = "auto"         # auto (ragged on TPU/GPU) | all_to_all (fixed slots) | ragged_all_to_all
  ep_capacity_factor: float = 2.0   # EP receive buffer = factor × a device's own token-expert pairs; 0 = worst case

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
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig.remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
    if self.ep_dispatch not in EP_DISPATCHES:
      raise ValueError(f"ModelConfig.ep_dispatch must be one of {EP_DISPATCHES}, got {self.ep_dispatch!r}")
    if self.ep_capacity_factor < 0:
      raise ValueError(f"ModelConfig.ep_capacity_factor must be >= 0 (0 = worst case), got {self.ep_capacity_factor}")
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


def _moonlight() -> ModelConfig:
  """Moonlight-16B-A3B as published (moonshotai/Moonlight-16B-A3B config.json): the K2
  architecture at 16B total / 3B activated, no q-LoRA, RoPE θ 50000 without YaRN."""
  return ModelConfig(
      vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
      num_hidden_layers=27, num_attention_heads=16, n_shared_experts=2, n_routed_experts=64,
      num_experts_per_tok=6, routed_scaling_factor=2.446, n_group=1, topk_group=1,
      first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
      qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
      rope_theta=50000.0, rope_scaling=None, dtype="bfloat16", param_dtype="bfloat16")


PRESETS = {"tiny": ModelConfig, "small": _small, "moonlight": _moonlight, "k25": _k25}


def preset(name: str, **overrides: Any) -> ModelConfig:
  """`preset("tiny" | "small" | "moonlight" | "k25", **field_overrides)`."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
  base = PRESETS[name]()
  return base.replace(**overrides) if overrides else base


def param_counts(cfg: ModelConfig) -> dict[str, int]:
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


# ============================================================== K2.5 multimodal
VISION_OURS = ("attention_impl", "dtype", "param_dtype")
# Released-checkpoint (`vt_*`) spellings of the vision_config fields → ours (transformers' names).
RELEASED_VISION_NAMES = {
    "vt_hidden_size": "hidden_size", "vt_num_hidden_layers": "num_hidden_layers",
    "vt_num_attention_heads": "num_attention_heads", "vt_intermediate_size": "intermediate_size",
    "init_pos_emb_height": "pos_emb_height", "init_pos_emb_width": "pos_emb_width",
    "init_pos_emb_time": "pos_emb_time",
}
# Released vision_config switches and the only values MoonViT-3D implements.
RELEASED_VISION_FIXED = {
    "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal", "pos_emb_type": "divided_fixed",
    "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu",
}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """MoonViT-3D's hyper-parameters (transformers' `Kimi_K25VisionConfig` names).

  Fixed by the architecture (not fields): 3 input channels, LayerNorm eps 1e-5, fused qkv
  and every linear with bias, and the 2-D RoPE over the whole head (18 frequencies per axis
  at head dim 72).
  """

  patch_size: int = 14
  pos_emb_height: int = 16
  pos_emb_width: int = 16
  pos_emb_time: int = 4
  num_attention_heads: int = 4
  num_hidden_layers: int = 2
  hidden_size: int = 64
  intermediate_size: int = 128
  hidden_act: str = "gelu_pytorch_tanh"
  merge_kernel_size: tuple[int, int] = (2, 2)
  rope_theta: float = 10000.0
  initializer_range: float = 0.02
  # --- ours
  attention_impl: str = "xla"       # xla | pallas | auto (Pallas when compiled for TPU/GPU, else XLA), as the decoder
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    object.__setattr__(self, "merge_kernel_size", tuple(int(k) for k in self.merge_kernel_size))
    self.validate()

  def validate(self) -> None:
    """Raises ValueError naming the first inconsistent field."""
    for name in ("patch_size", "pos_emb_height", "pos_emb_width", "pos_emb_time", "num_attention_heads",
                 "num_hidden_layers", "hidden_size", "intermediate_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"VisionConfig.{name} must be a positive int, got {value!r}")
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(f"VisionConfig.hidden_size={self.hidden_size} is not divisible by "
                       f"num_attention_heads={self.num_attention_heads}")
    if self.head_dim % 4:
      raise ValueError(f"VisionConfig: head dim {self.head_dim} must be a multiple of 4 "
                       "(2-D RoPE rotates pairs, half of them by row and half by column)")
    if self.hidden_size % 2:
      raise ValueError(f"VisionConfig.hidden_size must be even (sin/cos time embedding), got {self.hidden_size}")
    if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) <= 0:
      raise ValueError(f"VisionConfig.merge_kernel_size must be two positive ints, got {self.merge_kernel_size}")
    if self.hidden_act != "gelu_pytorch_tanh":
      raise ValueError(f"VisionConfig.hidden_act: only 'gelu_pytorch_tanh' is supported, got {self.hidden_act!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"VisionConfig.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"VisionConfig.{name} must be one of {DTYPES}, got {getattr(self, name)!r}")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @property
  def merge_size(self) -> int:
    """Patches per merged token (kh·kw, 4 for the 2×2 merger)."""
    return self.merge_kernel_size[0] * self.merge_kernel_size[1]

  def replace(self, **changes: Any) -> "VisionConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf_dict(cls, hf: dict, **ours: Any) -> "VisionConfig":
    """From a `vision_config` dict: transformers' names or the released `vt_*` names."""
    hf = dict(hf)
    for released, name in RELEASED_VISION_NAMES.items():
      if released in hf:
        hf.setdefault(name, hf.pop(released))
    for key, supported in RELEASED_VISION_FIXED.items():
      if key in hf and hf[key] != supported:
        raise ValueError(f"vision_config.{key}={hf[key]!r} is not supported (only {supported!r})")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
      raise ValueError(f"vision_config.rope_parameters: only axial 2-D RoPE, got {rope.get('rope_type')!r}")
    fields = {f.name for f in dataclasses.fields(cls)} - set(VISION_OURS) - {"rope_theta"}
    kwargs = {k: v for k, v in hf.items() if k in fields}
    return cls(**kwargs, rope_theta=float(rope.get("rope_theta", 10000.0)), **ours)

  def to_hf_dict(self) -> dict:
    """The `vision_config` dict transformers' `Kimi_K25VisionConfig` loads."""
    skip = VISION_OURS + ("rope_theta",)
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
    out.update(model_type="kimi_k25_vision", merge_kernel_size=list(self.merge_kernel_size),
               rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta})
    return out


@dataclasses.dataclass(frozen=True)
class K25Config:
  """Kimi K2.5: the K2 text backbone, MoonViT-3D and the projector (`Kimi_K25Config` names).

  Media placeholders: `image_token_id` (`<|media_pad|>`) and `video_token_id` rows of the
  token stream are replaced, in order, by projector outputs. `video_token_id` may lie outside
  the vocabulary (transformers' default 163840 does): placeholders never reach the embedding.
  """

  text: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
  projection_hidden_size: int = 64
  projection_layer_norm_eps: float = 1e-5
  image_token_id: int = 4091
  video_token_id: int = 4092
  vision_start_token_id: int = 4088
  vision_end_token_id: int = 4090

  def __post_init__(self):
    self.validate()

  def __hash__(self):
    return hash((self.text, self.vision, self.projection_hidden_size, self.projection_layer_norm_eps,
                 self.media_token_ids, self.vision_start_token_id, self.vision_end_token_id))

  def validate(self) -> None:
    if not isinstance(self.text, ModelConfig):
      raise ValueError(f"K25Config.text must be a ModelConfig, got {type(self.text).__name__}")
    if not isinstance(self.vision, VisionConfig):
      raise ValueError(f"K25Config.vision must be a VisionConfig, got {type(self.vision).__name__}")
    if self.projection_hidden_size != self.vision.hidden_size:
      raise ValueError(f"K25Config.projection_hidden_size={self.projection_hidden_size} must equal "
                       f"vision.hidden_size={self.vision.hidden_size} (the projector normalises each "
                       "merged sub-patch)")
    if not self.projection_layer_norm_eps > 0:
      raise ValueError(f"K25Config.projection_layer_norm_eps must be positive, got {self.projection_layer_norm_eps}")
    vocab = self.text.vocab_size
    for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
      value = getattr(self, name)
      if not isinstance(value, int) or not 0 <= value < vocab:
        raise ValueError(f"K25Config.{name} must lie in [0, text.vocab_size={vocab}), got {value!r}")
    if not isinstance(self.video_token_id, int) or self.video_token_id < 0:
      raise ValueError(f"K25Config.video_token_id must be a non-negative int, got {self.video_token_id!r}")
    if self.video_token_id == self.image_token_id:
      raise ValueError(f"K25Config.video_token_id must differ from image_token_id ({self.image_token_id})")

  @property
  def media_token_ids(self) -> tuple[int, int]:
    return (self.image_token_id, self.video_token_id)

  def replace(self, **changes: Any) -> "K25Config":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf_dict(cls, hf: dict, **ours: Any) -> "K25Config":
    """From a K2.5 `config.json`: transformers' layout or the released one (`vt_*` vision names,
    `media_placeholder_token_id`, `mm_hidden_size`/`projector_ln_eps`).

    ours: ModelConfig fields of ours; `attention_impl`/`dtype`/`param_dtype` apply to the
    vision tower too.
    """
    if "vision_config" not in hf or "text_config" not in hf:
      raise ValueError("a K2.5 config.json needs both 'text_config' and 'vision_config'")
    vision_hf = hf["vision_config"]
    text = ModelConfig.from_hf_dict(hf["text_config"], **ours)
    if "tie_word_embeddings" in hf:
      text = text.replace(tie_word_embeddings=bool(hf["tie_word_embeddings"]))
    vision = VisionConfig.from_hf_dict(vision_hf, **{k: v for k, v in ours.items() if k in VISION_OURS})
    image_id = hf.get("image_token_id", hf.get("media_placeholder_token_id", 163605))
    return cls(
        text=text, vision=vision,
        projection_hidden_size=hf.get("projection_hidden_size") or vision.hidden_size,
        projection_layer_norm_eps=float(hf.get("projection_layer_norm_eps",
                                               vision_hf.get("projector_ln_eps", 1e-5))),
        image_token_id=int(image_id), video_token_id=int(hf.get("video_token_id", 163840)),
        vision_start_token_id=int(hf.get("vision_start_token_id", 163602)),
        vision_end_token_id=int(hf.get("vision_end_token_id", 163604)))

  def to_hf_dict(self) -> dict:
    """The `config.json` dict transformers' `Kimi_K25Config` loads."""
    text = self.text.to_hf_dict()
    text.pop("architectures", None)
    return {
        "architectures": ["Kimi_K25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "vision_config": self.vision.to_hf_dict(),
        "projection_hidden_size": self.projection_hidden_size,
        "projection_layer_norm_eps": self.projection_layer_norm_eps,
        "image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
        "vision_start_token_id": self.vision_start_token_id,
        "vision_end_token_id": self.vision_end_token_id,
        "tie_word_embeddings": self.text.tie_word_embeddings, "dtype": self.text.param_dtype,
    }


def own_fields(cfg: "ModelConfig | K25Config") -> dict[str, Any]:
  """k25jax's own fields (`OURS`: layout, dtypes, kernels) of a config's text model: what a
  config.json does not hold, and `from_hf_dict(hf, **own_fields(cfg))` takes back."""
  text = cfg.text if isinstance(cfg, K25Config) else cfg
  return {name: getattr(text, name) for name in OURS}


def _k25_vision() -> VisionConfig:
  return VisionConfig(patch_size=14, pos_emb_height=64, pos_emb_width=64, pos_emb_time=4,
                      num_attention_heads=16, num_hidden_layers=27, hidden_size=1152,
                      intermediate_size=4304, merge_kernel_size=(2, 2), rope_theta=10000.0,
                      dtype="bfloat16", param_dtype="bfloat16")


def _k25_multimodal() -> K25Config:
  return K25Config(text=_k25(), vision=_k25_vision(), projection_hidden_size=1152,
                   image_token_id=163605, video_token_id=163840, vision_start_token_id=163602,
                   vision_end_token_id=163604)


K25_PRESETS = {"tiny": K25Config, "k25": _k25_multimodal}


def k25_preset(name: str, **overrides: Any) -> K25Config:
  """`k25_preset("tiny" | "k25", **field_overrides)`: the multimodal model's config.

  tiny: the tiny text backbone + a 2-layer, width-64 MoonViT-3D (16×16 position table),
  media ids at the top of the 4096-token vocabulary. k25: the released Kimi K2.5.
  """
  if name not in K25_PRESETS:
    raise ValueError(f"unknown K2.5 preset {name!r}; choose from {sorted(K25_PRESETS)}")
  base = K25_PRESETS[name]()
  return base.replace(**overrides) if overrides else base
