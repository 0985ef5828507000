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

import functools

import jax
import jax.numpy as jnp
import numpy as np


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                     segment_ids: jax.Array | None = None, chunk: int = 128
                     ) -> tuple[jax.Array, jax.Array]:
  """softmax(scale·q·kᵀ + mask)·v with causal ∧ same-segment mask, and per-head max logits.

  q, k: [b, s, h, d_qk]; v: [b, s, h, d_v]; segment_ids: [b, s], 0 = padding (padding
  queries are left out of the max). Queries are processed in chunks of `chunk` rows that
  only see their causal prefix of keys, so the masked upper triangle is mostly skipped.
  Returns (out [b, s, h, d_v], max_logits [h] float32).

  The backward is written out (`_attention_bwd`): each chunk keeps only its probabilities P
  for it, where autodiff kept the masked logits, the exponentials and the quotient (the
  reference train step's temporaries 1.39 → 1.05 GB, a fifth fewer page faults a step):

      dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − rowsum(dO ∘ O)),   dQ = scale · dS K,   dK = scale · dSᵀ Q.
  """
  segments = jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)                                    # [b, h, s, d]
  out, row_max = _attention(heads_first(q), heads_first(k), heads_first(v), segments, scale, chunk)
  row_max = jnp.where(segments[:, None, :] > 0, jax.lax.stop_gradient(row_max), -jnp.inf)
  return heads_first(out), jnp.max(row_max, axis=(0, 2))


def _query_chunks(seq: int, chunk: int) -> list[tuple[int, int]]:
  chunk = chunk if seq % chunk == 0 else seq
  return [(start, start + chunk) for start in range(0, seq, chunk)]


def _chunk_probs(q, k, segments, scale, start, stop):
  """P = softmax over keys [0, stop) of the queries [start, stop) (f32), and their row max."""
  logits = jnp.einsum("bhqd,bhkd->bhqk", q[:, :, start:stop], k[:, :, :stop],
                      preferred_element_type=jnp.float32) * scale
  mask = (jnp.arange(start, stop)[:, None] >= jnp.arange(stop)[None, :])[None, None]
  mask = mask & (segments[:, None, start:stop, None] == segments[:, None, None, :stop])
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)            # finite: a query always sees itself
  probs = jnp.exp(logits - row_max)
  return probs * (1.0 / jnp.sum(probs, axis=-1, keepdims=True)), row_max[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, segments, scale, chunk):
  """(out [b, h, s, d_v], row max [b, h, s]) of q, k, v in [b, h, s, d]."""
  return _attention_fwd(q, k, v, segments, scale, chunk)[0]


def _attention_fwd(q, k, v, segments, scale, chunk):
  outs, probs, row_maxes = [], [], []
  for start, stop in _query_chunks(q.shape[2], chunk):
    p, row_max = _chunk_probs(q, k, segments, scale, start, stop)
    p = p.astype(v.dtype)
    outs.append(jnp.einsum("bhqk,bhkd->bhqd", p, v[:, :, :stop]))
    probs.append(p)
    row_maxes.append(row_max)
  out = jnp.concatenate(outs, axis=2)
  return (out, jnp.concatenate(row_maxes, axis=2)), (q, k, v, segments, out, probs)


def _attention_bwd(scale, chunk, saved, cotangents):
  """The cotangents of q, k, v (the row max is not differentiated: QK-Clip only reads it)."""
  q, k, v, segments, out, probs = saved
  d_out = cotangents[0]
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  dq, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  for (start, stop), p in zip(_query_chunks(q.shape[2], chunk), probs):
    d_out_chunk = d_out[:, :, start:stop]
    dv = dv.at[:, :, :stop].add(jnp.einsum("bhqk,bhqd->bhkd", p, d_out_chunk, preferred_element_type=jnp.float32))
    dp = jnp.einsum("bhqd,bhkd->bhqk", d_out_chunk, v[:, :, :stop], preferred_element_type=jnp.float32)
    ds = (p.astype(jnp.float32) * (dp - delta[:, :, start:stop]) * scale).astype(q.dtype)
    dq.append(jnp.einsum("bhqk,bhkd->bhqd", ds, k[:, :, :stop], preferred_element_type=jnp.float32))
    dk = dk.at[:, :, :stop].add(jnp.einsum("bhqk,bhqd->bhkd", ds, q[:, :, start:stop],
                                           preferred_element_type=jnp.float32))
  return (jnp.concatenate(dq, axis=2).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          np.zeros(segments.shape, jax.dtypes.float0))


_attention.defvjp(_attention_fwd, _attention_bwd)


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
