"""Flash attention for MLA training: causal, packed segments, q/k head dim ≠ v head dim, and
the per-head max logit QK-Clip reads.

    o_i = Σ_j softmax_j(scale · q_i·k_j) v_j over j ≤ i ∧ seg_i = seg_j,
    max_logits_h = max over rows i with seg_i > 0 and visible j of scale · q_i·k_j.

The kernels (forward, FlashAttention-2 backward, the TPU tiled and GPU rows formulations)
are `pallas_kernels.flash_attention`'s in its causal mode; the row max comes out of the
forward's online softmax. The XLA reference is `k25jax.ops.attention.causal_attention`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k25jax.ops import attention as xla_attention
from pallas_kernels import flash_attention as flash


def reference(q, k, v, scale, segment_ids=None, chunk: int = 128):
  """The XLA path: `k25jax.ops.attention.causal_attention` → (out [b,s,h,dv], max_logits [h])."""
  return xla_attention.causal_attention(q, k, v, scale, segment_ids, chunk)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                    segment_ids: jax.Array | None = None, *, block_q: int | None = None,
                    block_k: int | None = None, interpret: bool | None = None,
                    formulation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """Causal MLA attention, the same contract as `causal_attention` (differentiable in q, k, v).

  q, k: [b, s, h, d_qk]; v: [b, s, h, d_v]; segment_ids: [b, s] int, 0 = padding (padding
  queries are left out of the max). Returns (out [b, s, h, d_v], max_logits [h] float32).
  Blocks, `interpret` and `formulation` as in `flash_attention.flash_attention`.
  """
  seg = jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids
  out, row_max = flash.flash_attention(q, k, v, scale, seg, causal=True, block_q=block_q, block_k=block_k,
                                       interpret=interpret, formulation=formulation)
  row_max = jnp.where(seg[:, None, :] > 0, row_max, -jnp.inf)
  return out, jnp.max(row_max, axis=(0, 2))
