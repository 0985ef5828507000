"""Attention in plain jax.numpy: the XLA paths of MLA training and of the vision tower, and
the kernels' references.

`causal_attention` is what `k25jax.model.attention.MLA` runs with attention_impl="xla"
and what `pallas_kernels.mla_attention` is checked against:

    o_i = Σ_j softmax_j(scale · q_i·k_j + mask_ij) v_j,   mask: j ≤ i ∧ seg_i = seg_j,

with the per-head max of the unmasked logits (QK-Clip's input) beside the output.

`block_diagonal_attention` is MoonViT-3D's attention over one packed sequence of patches
(`k25jax.model.vision` with attention_impl="xla", and the reference of
`pallas_kernels.vision_attention`): the same softmax with scale = d^-1/2 and mask
seg_i = seg_j only (not causal).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                     segment_ids: jax.Array | None = None, chunk: int = 128
                     ) -> tuple[jax.Array, jax.Array]:
  """softmax(scale·q·kᵀ + mask)·v with causal ∧ same-segment mask, and per-head max logits.

  q, k: [b, s, h, d_qk]; v: [b, s, h, d_v]; segment_ids: [b, s], 0 = padding (padding
  queries are left out of the max). Queries are processed in chunks of `chunk` rows that
  only see their causal prefix of keys, so the masked upper triangle is mostly skipped.
  Returns (out [b, s, h, d_v], max_logits [h] float32).
  """
  seq = q.shape[1]
  chunk = chunk if seq % chunk == 0 else seq
  outs, row_maxes = [], []
  for start in range(0, seq, chunk):
    stop = start + chunk
    logits = jnp.einsum("bqhd,bkhd->bhqk", q[:, start:stop], k[:, :stop],
                        preferred_element_type=jnp.float32) * scale
    mask = (jnp.arange(start, stop)[:, None] >= jnp.arange(stop)[None, :])[None, None]
    if segment_ids is not None:
      mask = mask & (segment_ids[:, None, start:stop, None] == segment_ids[:, None, None, :stop])
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))      # [b, h, q, 1]
    probs = jnp.exp(logits - row_max)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    outs.append(jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v[:, :stop]))
    row_maxes.append(row_max[..., 0])
  row_max = jnp.concatenate(row_maxes, axis=2)                                      # [b, h, s]
  if segment_ids is not None:
    row_max = jnp.where(segment_ids[:, None, :] > 0, row_max, -jnp.inf)
  return jnp.concatenate(outs, axis=1), jnp.max(row_max, axis=(0, 2))


def block_diagonal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """softmax(q·kᵀ/√d + mask)·v over one packed sequence; patch i sees j iff same segment.

  q, k, v: [N, heads, head_dim]; segment_ids [N]. Materialises the [heads, N, N] logits:
  fine for the item sizes of training batches on CPU/one chip; the flash kernel
  `pallas_kernels.vision_attention` is the way to 16K-patch items.
  """
  scale = q.shape[-1] ** -0.5
  logits = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
  same = segment_ids[:, None] == segment_ids[None, :]
  logits = jnp.where(same[None], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("hqk,khd->qhd", probs, v.astype(jnp.float32)).astype(q.dtype)
