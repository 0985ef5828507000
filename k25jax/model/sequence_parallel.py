"""The Pallas flash attention under a mesh: heads ↔ sequence by all-to-all (Ulysses).

A Pallas kernel is one custom call that XLA's partitioner cannot split, so under a mesh it
runs inside `jax.shard_map`, each device on whole rows of its own heads. The decoder's
q, k, v [b, s, h, d] are laid out by the logical-axis rules: b over the batch axes, s over
`sequence` (activation_length), h over `tensor` (activation_heads). With S, T the sizes of
those two axes:

    q, k, v   P(batch, sequence, tensor)  →  P(batch, None, (sequence, tensor))   all-to-all
    o_dev     = flash(q_dev, k_dev, v_dev)          whole rows, h / (S·T) heads a device
    o         P(batch, None, (sequence, tensor))  →  P(batch, sequence, tensor)   all-to-all back
    max_h     = max over the batch axes of each device's per-head max logit        (pmax)

so the causal mask and the segments need no offsets: every device sees whole rows. The
all-to-alls move each of q, k, v and o once (a device sends and receives its own share), and
the kernel holds a few K/V tiles whatever the length (`pallas_kernels.flash_attention`).
Heads must divide over S·T. Without a mesh of more than one device the kernel runs as it is.
(`check_vma=False`: a pallas_call's outputs carry no record of the axes they vary over.)
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _mesh_axes(logical: str, mesh) -> tuple[str, ...]:
  """The mesh axes of more than one device that the current rules give `logical`."""
  entry = nn.logical_to_mesh_axes((logical,))[0]
  axes = () if entry is None else (tuple(entry) if isinstance(entry, (tuple, list)) else (entry,))
  return tuple(a for a in axes if mesh.shape[a] > 1)


def head_split_attention(attention, q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                         segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """`attention(q, k, v, scale, segment_ids) -> (out, max_logits [h])` per device, rows whole and
  heads split over `sequence` × `tensor` (module docstring). q, k: [b, s, h, d_qk]; v: [b, s, h, d_v];
  segment_ids [b, s] (None: one segment). Returns (out [b, s, h, d_v], max_logits [h] float32)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return attention(q, k, v, scale, segment_ids)
  batch = _mesh_axes("activation_batch", mesh)
  heads = _mesh_axes("activation_length", mesh) + _mesh_axes("activation_heads", mesh)
  split = 1
  for axis in heads:
    split *= mesh.shape[axis]
  if q.shape[2] % split:
    raise ValueError(f"sequence-parallel attention: {q.shape[2]} heads do not divide over the mesh axes "
                     f"{heads} ({split} devices)")
  seg = jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids
  rows = P(batch or None, None, heads or None, None)

  def local(q, k, v, seg):
    out, max_logits = attention(q, k, v, scale, seg)
    return out, jax.lax.pmax(max_logits, batch) if batch else max_logits

  return jax.shard_map(local, in_specs=(rows, rows, rows, P(batch or None, None)),
                       out_specs=(rows, P(heads or None)), check_vma=False)(q, k, v, seg)
