"""Multi-head Latent Attention (MLA): the training path and the latent-cache decode path.

Per token x (DeepSeek-V2/V3, names as in the checkpoint):

    q            = q_b(RMSNorm(q_a(x)))             → per head [q_nope (128) | q_rope (64)]
    [c, k_rope]  = kv_a_proj_with_mqa(x)            → latent c (512) and ONE rope key (64)
    [k_nope | v] = kv_b(RMSNorm(c))                 → per head k_nope (128), v (128)
    s_ij         = scale · (q_nope,i·k_nope,j + RoPE(q_rope,i)·RoPE(k_rope,j))
    o            = o_proj(softmax_j(s_ij + mask_ij) · v)

with scale = qk_head_dim^-1/2 · m², m the YaRN mscale (1 without YaRN). The
largest unmasked s_ij per head (`max_logits`, [heads]) is returned beside the
output: QK-Clip reads it after each step. The softmax runs as
`k25jax.ops.attention.causal_attention` (XLA) or `pallas_kernels.mla_attention`
(`ModelConfig.attention_impl`; under a mesh each device runs the kernel on whole rows of
its own heads, `k25jax.model.sequence_parallel`).

Decode caches only what kv_a produces — the normed latent c (512) and the rotated
rope key (64): 576 numbers per token per layer for K2.5 — and absorbs kv_b into
the query and the output (W_uk, W_uv are kv_b's k_nope and v slices):

    s_ij = scale · ((W_uk q_nope,i)·c_j + q_rope,i·k_rope,j),   o_i = W_uvᵀ Σ_j p_ij c_j.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k25jax.model import rope, sequence_parallel
from k25jax.model.config import ModelConfig, VisionConfig, yarn_attention_mscale
from k25jax.model.layers import Linear, RMSNorm, dtype_of
from k25jax.ops.attention import causal_attention

# The latent norms of the checkpoint use this eps whatever `rms_norm_eps` says.
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: ModelConfig) -> float:
  """qk_head_dim^-1/2 · m², m = 0.1 · mscale_all_dim · ln(factor) + 1."""
  return cfg.qk_head_dim ** -0.5 * yarn_attention_mscale(cfg) ** 2


def attention_impl(cfg: ModelConfig | VisionConfig) -> str:
  """"xla" | "pallas" for `cfg.attention_impl` ("auto": Pallas when compiled for TPU/GPU, XLA on CPU),
  the decoder's or the vision tower's."""
  if cfg.attention_impl == "auto":
    return "pallas" if jax.default_backend() in ("tpu", "gpu") else "xla"
  return cfg.attention_impl


class MLA(nn.Module):
  """MLA with per-head max pre-softmax logits as an auxiliary output."""

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    kw = dict(std=cfg.initializer_range, dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype))
    norm_kw = dict(eps=LATENT_NORM_EPS, dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype))
    d, h = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank:
      self.q_a_proj = Linear(d, cfg.q_lora_rank, ("embed", "q_lora"), use_bias=cfg.attention_bias, **kw)
      self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, axis_name="q_lora", **norm_kw)
      self.q_b_proj = Linear(cfg.q_lora_rank, (h, cfg.qk_head_dim), ("q_lora", "heads", "qk_head_dim"), **kw)
    else:
      self.q_proj = Linear(d, (h, cfg.qk_head_dim), ("embed", "heads", "qk_head_dim"), **kw)
    self.kv_a_proj_with_mqa = Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, ("embed", "kv_lora"),
                                     use_bias=cfg.attention_bias, **kw)
    self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, axis_name="kv_lora", **norm_kw)
    self.kv_b_proj = Linear(cfg.kv_lora_rank, (h, cfg.qk_nope_head_dim + cfg.v_head_dim),
                            ("kv_lora", "heads", "kv_head_dim"), **kw)
    self.o_proj = Linear((h, cfg.v_head_dim), d, ("heads", "kv_head_dim", "embed"),
                         use_bias=cfg.attention_bias, **kw)
    self.inv_freq, self.rope_scale = rope.inverse_frequencies(
        cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)

  def queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """q [b, s, h, nope + rope] with the rope channels rotated."""
    cfg = self.cfg
    if cfg.q_lora_rank:
      q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    else:
      q = self.q_proj(x)
    q_nope, q_rope = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
    return jnp.concatenate([q_nope, rope.apply_rope(q_rope, positions, self.inv_freq, self.rope_scale)], axis=-1)

  def latents(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """What the decode cache keeps: (normed latent [b, s, kv_lora], rotated k_rope [b, s, rope])."""
    cfg = self.cfg
    compressed = self.kv_a_proj_with_mqa(x)
    latent, k_rope = jnp.split(compressed, [cfg.kv_lora_rank], axis=-1)
    k_rope = rope.apply_rope(k_rope[:, :, None, :], positions, self.inv_freq, self.rope_scale)[:, :, 0]
    return self.kv_a_layernorm(latent), k_rope

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """x: [batch, seq, hidden] → (output [batch, seq, hidden], max_logits [heads] float32)."""
    cfg = self.cfg
    q = self.queries(x, positions)
    latent, k_rope = self.latents(x, positions)
    k_nope, v = jnp.split(self.kv_b_proj(latent), [cfg.qk_nope_head_dim], axis=-1)
    k_rope = jnp.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:3], cfg.qk_rope_head_dim))
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    q = nn.with_logical_constraint(q, ("activation_batch", "activation_length", "activation_heads", None))
    k = nn.with_logical_constraint(k, ("activation_batch", "activation_length", "activation_heads", None))
    if attention_impl(cfg) == "pallas":
      from pallas_kernels import mla_attention  # loaded only when chosen
      out, max_logits = sequence_parallel.head_split_attention(mla_attention.flash_attention, q, k, v,
                                                               softmax_scale(cfg), segment_ids)
    else:
      out, max_logits = causal_attention(q, k, v, softmax_scale(cfg), segment_ids)
    out = nn.with_logical_constraint(out, ("activation_batch", "activation_length", "activation_heads", None))
    return self.o_proj(out), jax.lax.stop_gradient(max_logits)

  def decode(self, x: jax.Array, positions: jax.Array, cache: dict
             ) -> tuple[jax.Array, jax.Array, dict]:
    """Attends over a latent cache; x: [b, t, hidden] at `positions` [b, t].

    cache: {"latent": [b, S, kv_lora], "k_rope": [b, S, rope]}. The new tokens' latents
    are written at slots `positions`; query (b, j) sees slots ≤ positions[b, j]
    (earlier slots must hold that sequence's tokens). Returns (output, max_logits, cache).
    """
    cfg = self.cfg
    q = self.queries(x, positions)
    q_nope, q_rope = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
    latent, k_rope = self.latents(x, positions)
    rows = jnp.arange(x.shape[0])[:, None]
    cache = {"latent": cache["latent"].at[rows, positions].set(latent.astype(cache["latent"].dtype)),
             "k_rope": cache["k_rope"].at[rows, positions].set(k_rope.astype(cache["k_rope"].dtype))}
    w_kv = self.kv_b_proj.variables["params"]["kernel"].astype(q.dtype)     # [kv_lora, h, nope + v]
    w_uk, w_uv = jnp.split(w_kv, [cfg.qk_nope_head_dim], axis=-1)
    q_latent = jnp.einsum("bthn,chn->bthc", q_nope, w_uk)
    if attention_impl(cfg) == "pallas":
      from pallas_kernels import mla_decode  # loaded only when chosen
      out_latent, max_logits = sequence_parallel.row_split_decode_attention(
          mla_decode.latent_attention, q_latent, q_rope, cache["latent"], cache["k_rope"], positions,
          softmax_scale(cfg))
    else:
      logits = (jnp.einsum("bthc,bsc->bhts", q_latent, cache["latent"].astype(q.dtype),
                           preferred_element_type=jnp.float32)
                + jnp.einsum("bthr,bsr->bhts", q_rope, cache["k_rope"].astype(q.dtype),
                             preferred_element_type=jnp.float32)) * softmax_scale(cfg)
      visible = jnp.arange(cache["latent"].shape[1])[None, None, None, :] <= positions[:, None, :, None]
      logits = jnp.where(visible, logits, -jnp.inf)
      max_logits = jnp.max(logits, axis=(0, 2, 3))
      probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
      out_latent = jnp.swapaxes(jnp.einsum("bhts,bsc->bhtc", probs, cache["latent"].astype(q.dtype)), 1, 2)
    out = jnp.einsum("bthc,chv->bthv", out_latent, w_uv)
    return self.o_proj(out), max_logits, cache


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> list[dict]:
  """An empty latent cache per layer: latent [b, S, kv_lora] and k_rope [b, S, rope]."""
  return [{"latent": jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
           "k_rope": jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype)}
          for _ in range(cfg.num_hidden_layers)]
