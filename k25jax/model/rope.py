"""Rotary position embeddings: RoPE on adjacent channel pairs, and YaRN.

The K2 checkpoint rotates ADJACENT pairs: channels (2i, 2i+1) form the complex
number z_i = x_{2i} + j·x_{2i+1}, rotated by angle p·θ_i at position p:

    (x_{2i}, x_{2i+1}) ↦ (x_{2i} cos − x_{2i+1} sin,  x_{2i+1} cos + x_{2i} sin).

YaRN (DeepSeek-V3 form) blends interpolated and extrapolated frequencies,

    θ_i = θ_i^interp · (1 − ε_i) + θ_i^extrap · ε_i,   ε_i = 1 − ramp(i; low, high),
    θ_i^extrap = base^(−2i/D),   θ_i^interp = θ_i^extrap / factor,

with low/high the (floored/ceiled) dimensions at which a wavelength completes
beta_fast / beta_slow rotations over the original context. cos/sin are scaled by
mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1 for K2.5), and the
attention softmax scale by mscale(factor, mscale_all_dim)² (see `config`).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def _mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
  """Dimension index whose wavelength makes `rotations` turns over `max_pos` tokens."""
  return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(dim: int, theta: float, rope_scaling: dict | None = None
                        ) -> tuple[np.ndarray, float]:
  """Returns (θ [dim/2] float32, cos/sin scale) for plain RoPE or YaRN."""
  extrap = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  if not rope_scaling:
    return extrap.astype(np.float32), 1.0
  factor = float(rope_scaling["factor"])
  original = int(rope_scaling["original_max_position_embeddings"])
  beta_fast = float(rope_scaling.get("beta_fast") or 32.0)
  beta_slow = float(rope_scaling.get("beta_slow") or 1.0)
  low = math.floor(_correction_dim(beta_fast, dim, theta, original))
  high = math.ceil(_correction_dim(beta_slow, dim, theta, original))
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrap_weight = 1.0 - ramp
  inv_freq = (extrap / factor) * (1 - extrap_weight) + extrap * extrap_weight
  mscale, mscale_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
  if mscale and mscale_all:
    scale = _mscale(factor, mscale) / _mscale(factor, mscale_all)
  else:
    scale = _mscale(factor)
  return inv_freq.astype(np.float32), float(scale)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray,
               scale: float = 1.0) -> jnp.ndarray:
  """Rotates adjacent pairs of the last axis of x.

  Args:
    x: [batch, seq, heads, dim] (heads may be 1 for MLA's shared rope key).
    positions: [batch, seq] integer positions.
    inv_freq: [dim/2] frequencies θ_i.
    scale: multiplies cos and sin (YaRN's attention factor).
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [b, s, dim/2]
  cos = (jnp.cos(angles) * scale)[:, :, None, :]
  sin = (jnp.sin(angles) * scale)[:, :, None, :]
  pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
  even, odd = pairs[..., 0], pairs[..., 1]
  rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return rotated.reshape(x.shape).astype(x.dtype)


def rotate_adjacent_pairs(x: jnp.ndarray, angles: jnp.ndarray) -> jnp.ndarray:
  """Rotates each adjacent channel pair (2k, 2k+1) of x by its own angle, in float32.

  Args:
    x: [..., seq, heads, dim].
    angles: [..., seq, dim/2], one angle per pair (broadcast over heads).
  """
  cos = jnp.cos(angles)[..., None, :]
  sin = jnp.sin(angles)[..., None, :]
  pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
  even, odd = pairs[..., 0], pairs[..., 1]
  rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return rotated.reshape(x.shape).astype(x.dtype)


def vision_rope_angles(rows: jnp.ndarray, cols: jnp.ndarray, head_dim: int, theta: float) -> jnp.ndarray:
  """MoonViT's 2-D RoPE angles: pair slot 2i turns by col·θ_i, slot 2i+1 by row·θ_i.

  θ_i = theta^(−4i/head_dim), i < head_dim/4 (18 frequencies per axis at head dim 72).
  rows, cols: [n] patch coordinates → angles [n, head_dim/2].
  """
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim // 2, 2, dtype=np.float32) / (head_dim // 2))
  col_angles = cols.astype(jnp.float32)[:, None] * inv_freq
  row_angles = rows.astype(jnp.float32)[:, None] * inv_freq
  return jnp.stack([col_angles, row_angles], axis=-1).reshape(rows.shape[0], head_dim // 2)
