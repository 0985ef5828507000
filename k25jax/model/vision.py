"""MoonViT-3D, the K2.5 vision tower: patch embedding, encoder, temporal-pool patch merger,
and the projector into the text model's hidden size.

All patches of all media items are packed into ONE sequence (NaViT). Item i has a grid
(t_i, h_i, w_i) in patches: t = 1 for an image, 1 < t ≤ pos_emb_time frames for a video
chunk; its t·h·w patches come frame by frame, each frame in raster order, and pixel_values
is [N, 3, p, p] (or [N, 3·p·p], channel-major), N = Σ_i t_i·h_i·w_i.

    x      = patch·W + b + P̃_i[row, col] + T[frame]        P̃_i: the learned table P bicubic-
                                                            resized to (h_i, w_i); T: sin/cos
    x      = x + Attn(LN0(x));  x = x + MLP(LN1(x))          × L; attention block-diagonal per
                                                            item, 2-D RoPE on q and k
    y      = LN_final(x)
    merged = mean over frames of y, grouped 2×2             [M, 4, D], M = Σ_i h_i·w_i / 4
    z      = W2·GELU(W1·flatten(LN(merged)) + b1) + b2      the projector, [M, text hidden]

Shapes depend on the grids, so the grids are host-side data: `patch_layout(grid_thw, cfg)`
turns them into a `PatchLayout` of per-patch index arrays (numpy). The modules accept either
a static grid tuple (the layout is built while tracing: one compilation per distinct grid
tuple) or a `PatchLayout` passed as jit arguments, padded to fixed sizes with
`patch_layout(..., num_patches=, num_merged=)`: then one compilation serves every batch whose
media fit the budget. Training should bucket media sizes one of these two ways.

The attention runs as `k25jax.ops.attention.block_diagonal_attention` (XLA, the [heads, N, N]
logits materialised) or `pallas_kernels.vision_attention` (flash, segment-aware: what a
16K-patch image needs), chosen by `VisionConfig.attention_impl`; under a mesh the kernel runs
in a shard_map, each device on the whole sequence of its own heads
(`k25jax.model.sequence_parallel.vision_head_split_attention`).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k25jax.model import rope, sequence_parallel
from k25jax.model.attention import attention_impl
from k25jax.model.config import VisionConfig
from k25jax.model.layers import Linear, dtype_of
from k25jax.ops.attention import block_diagonal_attention

LAYER_NORM_EPS = 1e-5
BICUBIC_A = -0.75      # the Keys kernel of torch's bicubic interpolation
TIME_BASE = 10000.0    # the sin/cos time embedding's base (fixed, not rope_theta)

Grid = Sequence[Sequence[int]]


# ------------------------------------------------------------------ host-side layout
class PatchLayout(NamedTuple):
  """Per-patch index arrays of a packed media batch (all numpy, or all jax inside jit).

  segment_ids [N]   item index + 1 (0 = padding): attention is block-diagonal over it
  rows, cols  [N]   the patch's row / column in its frame (2-D RoPE)
  frames      [N]   row of the time table: 0 for an image, f + 1 for frame f of a chunk
  pos_index   [N, 16], pos_weight [N, 16]: bicubic taps into the flattened position table
  merge_index [N]   slot m·K + k of `merged` [M, K, D] that the patch adds to (M·K: dropped)
  merge_weight [N]  1/t of its item (0 for padding): the temporal mean
  merged_items [M]  item index + 1 of each merged token (0 = padding)
  """

  segment_ids: np.ndarray
  rows: np.ndarray
  cols: np.ndarray
  frames: np.ndarray
  pos_index: np.ndarray
  pos_weight: np.ndarray
  merge_index: np.ndarray
  merge_weight: np.ndarray
  merged_items: np.ndarray

  @property
  def num_patches(self) -> int:
    return self.segment_ids.shape[0]

  @property
  def num_merged(self) -> int:
    return self.merged_items.shape[0]


def num_media_tokens(grid_thw_item: Sequence[int], merge_kernel_size: Sequence[int] = (2, 2)) -> int:
  """Placeholder tokens one item takes in the text: h·w / (kh·kw) (frames are pooled)."""
  _, h, w = (int(v) for v in grid_thw_item)
  return (h // merge_kernel_size[0]) * (w // merge_kernel_size[1])


def check_grid(grid_thw: Grid, cfg: VisionConfig) -> tuple[tuple[int, int, int], ...]:
  """Validates the grids and returns them as a tuple of int triples.

  Raises ValueError naming the item when a grid is not (t, h, w) with t, h, w ≥ 1, when h or w
  is not a multiple of the merge kernel, or when a chunk has more frames than the time table.
  """
  grids = []
  kh, kw = cfg.merge_kernel_size
  for i, item in enumerate(grid_thw):
    item = tuple(int(v) for v in np.asarray(item).reshape(-1))
    if len(item) != 3 or min(item) < 1:
      raise ValueError(f"grid_thw[{i}] must be (t, h, w) with positive entries, got {item}")
    t, h, w = item
    if h % kh or w % kw:
      raise ValueError(f"grid_thw[{i}] = {item}: h and w must be multiples of merge_kernel_size "
                       f"{cfg.merge_kernel_size} (pad images to multiples of {kh * cfg.patch_size} px)")
    if t > cfg.pos_emb_time:
      raise ValueError(f"grid_thw[{i}] = {item}: a chunk has at most pos_emb_time={cfg.pos_emb_time} "
                       f"frames, got t={t}")
    grids.append(item)
  if not grids:
    raise ValueError("grid_thw is empty: at least one media item is needed")
  return tuple(grids)


def _bicubic_taps(size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
  """Taps [size, 4] into a `side`-long axis and their weights, resampling it to `size`.

  torch's `F.interpolate(mode="bicubic", align_corners=False)`: source coordinate
  s = (i + ½)·side/size − ½, taps ⌊s⌋−1 … ⌊s⌋+2 clamped to the border, Keys kernel a = −0.75:
  W(d) = (a+2)|d|³ − (a+3)|d|² + 1 for |d| ≤ 1, a|d|³ − 5a|d|² + 8a|d| − 4a for 1 < |d| < 2.
  """
  src = (np.arange(size, dtype=np.float64) + 0.5) * side / size - 0.5
  floor = np.floor(src)
  offsets = np.arange(-1, 3)
  taps = floor[:, None].astype(np.int64) + offsets
  d = np.abs(src[:, None] - floor[:, None] - offsets)
  a = BICUBIC_A
  near = ((a + 2) * d - (a + 3)) * d * d + 1
  far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
  return np.clip(taps, 0, side - 1), np.where(d <= 1, near, far)


def patch_layout(grid_thw: Grid, cfg: VisionConfig, num_patches: int | None = None,
                 num_merged: int | None = None) -> PatchLayout:
  """The `PatchLayout` of media items packed in order, optionally padded.

  num_patches / num_merged: pad to these sizes (a fixed budget, so jit compiles once); they
  must be at least Σ t·h·w and Σ h·w/(kh·kw). Padding patches form segment 0 and are dropped
  by the merger; padded merged tokens have merged_items = 0 (no items: all padding, as a media
  shard whose rows hold no media).
  """
  grids = check_grid(grid_thw, cfg) if len(grid_thw) else ()
  kh, kw = cfg.merge_kernel_size
  k = kh * kw
  side_h, side_w = cfg.pos_emb_height, cfg.pos_emb_width
  parts = {name: [] for name in PatchLayout._fields}
  merged_offset = 0
  for item, (t, h, w) in enumerate(grids, start=1):
    row, col = np.divmod(np.arange(h * w), w)
    parts["segment_ids"].append(np.full(t * h * w, item))
    parts["rows"].append(np.tile(row, t))
    parts["cols"].append(np.tile(col, t))
    parts["frames"].append(np.repeat(np.arange(t) + (1 if t > 1 else 0), h * w))
    row_taps, row_w = _bicubic_taps(h, side_h)
    col_taps, col_w = _bicubic_taps(w, side_w)
    index = (row_taps[row][:, :, None] * side_w + col_taps[col][:, None, :]).reshape(h * w, 16)
    weight = (row_w[row][:, :, None] * col_w[col][:, None, :]).reshape(h * w, 16)
    parts["pos_index"].append(np.tile(index, (t, 1)))
    parts["pos_weight"].append(np.tile(weight, (t, 1)))
    merged = (row // kh) * (w // kw) + col // kw
    slot = (merged_offset + merged) * k + (row % kh) * kw + col % kw
    parts["merge_index"].append(np.tile(slot, t))
    parts["merge_weight"].append(np.full(t * h * w, 1.0 / t))
    n_merged = num_media_tokens((t, h, w), cfg.merge_kernel_size)
    parts["merged_items"].append(np.full(n_merged, item))
    merged_offset += n_merged
  trailing = dict(pos_index=(16,), pos_weight=(16,))     # an empty item list: all-padding layout
  layout = {name: np.concatenate(arrays) if arrays else np.zeros((0,) + trailing.get(name, ()))
            for name, arrays in parts.items()}
  n, m = layout["segment_ids"].shape[0], merged_offset
  num_patches = n if num_patches is None else int(num_patches)
  num_merged = m if num_merged is None else int(num_merged)
  if num_patches < n:
    raise ValueError(f"patch_layout: num_patches={num_patches} is below the {n} patches of grid_thw")
  if num_merged < m:
    raise ValueError(f"patch_layout: num_merged={num_merged} is below the {m} merged tokens of grid_thw")
  pad, pad_m = num_patches - n, num_merged - m
  fill = dict(segment_ids=0, rows=0, cols=0, frames=0, pos_index=0, pos_weight=0.0,
              merge_index=num_merged * k, merge_weight=0.0, merged_items=0)
  dtypes = dict(pos_weight=np.float32, merge_weight=np.float32)
  out = {}
  for name, value in layout.items():
    extra = pad_m if name == "merged_items" else pad
    widths = [(0, extra)] + [(0, 0)] * (value.ndim - 1)
    out[name] = np.pad(value, widths, constant_values=fill[name]).astype(dtypes.get(name, np.int32))
  return PatchLayout(**out)


def as_layout(grid_or_layout, cfg: VisionConfig) -> PatchLayout:
  """A PatchLayout from a static grid tuple, or the layout itself."""
  if isinstance(grid_or_layout, PatchLayout):
    return grid_or_layout
  return patch_layout(grid_or_layout, cfg)


def time_embedding(num_frames: int, dim: int) -> np.ndarray:
  """[num_frames + 1, dim]: row 0 zeros (images), row f+1 = [sin(f·ω), cos(f·ω)], ω_j = 10000^(−2j/dim)."""
  inv_freq = 1.0 / TIME_BASE ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  angles = np.arange(num_frames, dtype=np.float32)[:, None] * inv_freq
  table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
  return np.concatenate([np.zeros((1, dim), np.float32), table]).astype(np.float32)


# --------------------------------------------------------------------------- modules
class LayerNorm(nn.Module):
  """y = w ⊙ (x − mean(x)) / sqrt(var(x) + eps) + b over the last axis, in float32."""

  dim: int
  eps: float = LAYER_NORM_EPS
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    axes = ("vit_norm",)
    weight = self.param("weight", nn.with_logical_partitioning(nn.initializers.ones, axes),
                        (self.dim,), self.param_dtype)
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, axes),
                      (self.dim,), self.param_dtype)
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


class PositionTable(nn.Module):
  """The learned [pos_emb_height, pos_emb_width, D] table, resampled per patch by its taps."""

  cfg: VisionConfig

  @nn.compact
  def __call__(self, pos_index: jax.Array, pos_weight: jax.Array) -> jax.Array:
    cfg = self.cfg
    table = self.param(
        "weight", nn.with_logical_partitioning(nn.initializers.truncated_normal(1.0),
                                               ("vit_pos", None, "vit_embed")),
        (cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size), dtype_of(cfg.param_dtype))
    flat = table.reshape(-1, cfg.hidden_size).astype(jnp.float32)
    return jnp.einsum("nk,nkd->nd", pos_weight.astype(jnp.float32), flat[pos_index])


class PatchEmbed(nn.Module):
  """x = patch·W + b (the stride-p convolution as a matmul) + resized table + time embedding."""

  cfg: VisionConfig

  @nn.compact
  def __call__(self, pixel_values: jax.Array, layout: PatchLayout) -> jax.Array:
    cfg = self.cfg
    patch_dim = 3 * cfg.patch_size * cfg.patch_size
    x = Linear(patch_dim, cfg.hidden_size, ("vit_patch", "vit_embed"), std=cfg.initializer_range,
               use_bias=True, dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype),
               name="proj")(pixel_values.reshape(pixel_values.shape[0], patch_dim))
    pos = PositionTable(cfg, name="pos_emb")(layout.pos_index, layout.pos_weight)
    time = jnp.asarray(time_embedding(cfg.pos_emb_time, cfg.hidden_size))[layout.frames]
    return (x.astype(jnp.float32) + pos + time).astype(dtype_of(cfg.dtype))


class VisionBlock(nn.Module):
  """Pre-norm block: x + Attn(norm0(x)), then + MLP(norm1(x)); fused qkv, every linear biased."""

  cfg: VisionConfig

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array, angles: jax.Array) -> jax.Array:
    cfg = self.cfg
    heads, head_dim, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    kw = dict(std=cfg.initializer_range, use_bias=True, dtype=dtype_of(cfg.dtype),
              param_dtype=dtype_of(cfg.param_dtype))
    norm = dict(dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype))
    qkv = Linear(d, (3, heads, head_dim), ("vit_embed", "vit_qkv", "vit_heads", "vit_head_dim"),
                 name="wqkv", **kw)(LayerNorm(d, name="norm0", **norm)(x))
    q = rope.rotate_adjacent_pairs(qkv[:, 0], angles)
    k = rope.rotate_adjacent_pairs(qkv[:, 1], angles)
    if attention_impl(cfg) == "pallas":
      from pallas_kernels import vision_attention  # loaded only when chosen
      attn = sequence_parallel.vision_head_split_attention(vision_attention.flash_attention, q, k, qkv[:, 2],
                                                           segment_ids)
    else:
      attn = block_diagonal_attention(q, k, qkv[:, 2], segment_ids)
    x = x + Linear((heads, head_dim), d, ("vit_heads", "vit_head_dim", "vit_embed"), name="wo", **kw)(attn)
    h = LayerNorm(d, name="norm1", **norm)(x)
    mlp = VisionMLP(cfg, name="mlp")
    return x + mlp(h)


class VisionMLP(nn.Module):
  """fc1(GELU_tanh(fc0(x)))."""

  cfg: VisionConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    kw = dict(std=cfg.initializer_range, use_bias=True, dtype=dtype_of(cfg.dtype),
              param_dtype=dtype_of(cfg.param_dtype))
    h = Linear(cfg.hidden_size, cfg.intermediate_size, ("vit_embed", "vit_mlp"), name="fc0", **kw)(x)
    h = jax.nn.gelu(h, approximate=True)
    return Linear(cfg.intermediate_size, cfg.hidden_size, ("vit_mlp", "vit_embed"), name="fc1", **kw)(h)


class VisionEncoder(nn.Module):
  """The L blocks and the final LayerNorm."""

  cfg: VisionConfig

  @nn.compact
  def __call__(self, x: jax.Array, layout: PatchLayout) -> jax.Array:
    cfg = self.cfg
    angles = rope.vision_rope_angles(jnp.asarray(layout.rows), jnp.asarray(layout.cols),
                                     cfg.head_dim, cfg.rope_theta)
    segment_ids = jnp.asarray(layout.segment_ids)
    for i in range(cfg.num_hidden_layers):
      x = VisionBlock(cfg, name=f"blocks_{i}")(x, segment_ids, angles)
    return LayerNorm(cfg.hidden_size, name="final_layernorm", dtype=dtype_of(cfg.dtype),
                     param_dtype=dtype_of(cfg.param_dtype))(x)


def temporal_pool_merge(y: jax.Array, layout: PatchLayout, kernel_size: int) -> jax.Array:
  """merged[m, k] = Σ_patches→(m, k) y / t: the mean over frames, grouped kh×kw → [M, K, D]."""
  m = layout.num_merged
  weighted = y.astype(jnp.float32) * jnp.asarray(layout.merge_weight)[:, None]
  pooled = jnp.zeros((m * kernel_size, y.shape[-1]), jnp.float32)
  pooled = pooled.at[jnp.asarray(layout.merge_index)].add(weighted, mode="drop")
  return pooled.reshape(m, kernel_size, y.shape[-1]).astype(y.dtype)


class MoonViT3D(nn.Module):
  """The vision tower: pixel_values [N, 3, p, p] + grids → merged features [M, kh·kw, D]."""

  cfg: VisionConfig

  @nn.compact
  def __call__(self, pixel_values: jax.Array, grid_thw: Grid | PatchLayout) -> jax.Array:
    """grid_thw: a static tuple of (t, h, w) per item, or a PatchLayout (see the module doc)."""
    cfg = self.cfg
    layout = as_layout(grid_thw, cfg)
    patch_dim = 3 * cfg.patch_size * cfg.patch_size
    if pixel_values.shape[0] != layout.num_patches or math.prod(pixel_values.shape[1:]) != patch_dim:
      raise ValueError(f"pixel_values has shape {pixel_values.shape}; the grids need "
                       f"[{layout.num_patches}, 3, {cfg.patch_size}, {cfg.patch_size}]")
    x = PatchEmbed(cfg, name="patch_embed")(pixel_values, layout)
    y = VisionEncoder(cfg, name="encoder")(x, layout)
    return temporal_pool_merge(y, layout, cfg.merge_size)


class Projector(nn.Module):
  """mm_projector: z = proj_2(GELU(proj_0(flatten(pre_norm(merged))))), exact GELU.

  merged [M, K, D] → [M, out_features]; pre_norm normalises each of the K sub-patches.
  """

  cfg: VisionConfig
  out_features: int
  eps: float = LAYER_NORM_EPS

  @nn.compact
  def __call__(self, merged: jax.Array) -> jax.Array:
    cfg = self.cfg
    d_in = cfg.merge_size * cfg.hidden_size
    kw = dict(std=cfg.initializer_range, use_bias=True, dtype=dtype_of(cfg.dtype),
              param_dtype=dtype_of(cfg.param_dtype))
    h = LayerNorm(cfg.hidden_size, eps=self.eps, name="pre_norm", dtype=dtype_of(cfg.dtype),
                  param_dtype=dtype_of(cfg.param_dtype))(merged)
    h = Linear(d_in, d_in, ("mm_in", "mm_hidden"), name="proj_0", **kw)(h.reshape(h.shape[0], d_in))
    h = jax.nn.gelu(h, approximate=False)
    return Linear(d_in, self.out_features, ("mm_hidden", "embed"), name="proj_2", **kw)(h)
