"""Flash attention for MoonViT-3D: one packed sequence of patches, block-diagonal per item.

    o_i = Σ_j softmax_j(q_i·k_j / √d) v_j   over j with seg_j = seg_i   (not causal),

q, k, v [N, heads, d] (d = 72 at K2.5 size), N all patches of all media. The kernels
(forward, FlashAttention-2 backward, the TPU tiled and GPU rows formulations) are
`pallas_kernels.flash_attention`'s in its segment mode: a query block visits only the key
blocks within reach of its segments (and a key block only those query blocks), so a batch
of many small images costs about Σ_i n_i² rather than N², and a 16K-patch image never
holds its [heads, N, N] logits. The XLA reference is
`k25jax.ops.attention.block_diagonal_attention`.

At 16,384 patches (one image at the size limit) with K2.5's 16 heads of 72, bf16, the TPU
blocks (256, 512), compiled for a v5p chip (libtpu, no TPU): 1.9 / 2.3 / 1.5 MiB of scoped
VMEM for forward / dK,dV / dQ (of the default 16 MiB), and 0.63 GiB of temporaries for
forward + backward against 32.3 GiB for the XLA path. Most of the 0.63 GiB is the [heads, N, 1]
float32 columns (lse, row max, D), which the TPU layout pads to 128 lanes: 128 MiB each.
"""
from __future__ import annotations

import jax

from k25jax.ops import attention as xla_attention
from pallas_kernels import flash_attention as flash


def reference(q, k, v, segment_ids):
  """The XLA path: `k25jax.ops.attention.block_diagonal_attention` → out [N, heads, d]."""
  return xla_attention.block_diagonal_attention(q, k, v, segment_ids)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                    block_q: int | None = None, block_k: int | None = None,
                    interpret: bool | None = None, formulation: str | None = None) -> jax.Array:
  """Block-diagonal attention, the same contract as `block_diagonal_attention` (differentiable
  in q, k, v): q, k, v [N, heads, d]; segment_ids [N] int ≥ 0 (the layout's padding, 0, is
  one more segment). Returns out [N, heads, d]. Blocks, `interpret` and `formulation` as in
  `flash_attention.flash_attention`.
  """
  out, _ = flash.flash_attention(q[None], k[None], v[None], q.shape[-1] ** -0.5, segment_ids[None],
                                 causal=False, block_q=block_q, block_k=block_k, interpret=interpret,
                                 formulation=formulation)
  return out[0]
