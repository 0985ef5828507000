"""The Pallas kernels under a mesh: each device on whole rows of its own heads, or on its own tokens.

A Pallas kernel is one custom call that XLA's partitioner cannot split (Mosaic refuses to be
partitioned automatically), so under a mesh it runs inside `jax.shard_map`. The decoder's
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

The vision tower's packed sequence q, k, v [N, h, d] (`vision_head_split_attention`) is
already whole on every device that holds it: the heads split over `tensor` and nothing
moves. With media in D shards the tower runs under `nn.vmap(spmd_axis_name=batch axes)`
(`k25jax.model.k25`), and the shard_map's batching rule splits the shard axis over the batch
axes, so each data shard runs the kernel on its own media.

The MoE kernels (routing, the dropless expert layer) work token by token: under a mesh
`token_split` runs them on each device's own tokens, the router bias and the expert weights
whole. (Under expert parallelism the expert layer is `k25jax.model.expert_parallel`'s.)

The latent-cache decode kernel (`row_split_decode_attention`) runs on each device's own
rows of the cache (rows over the batch axes, as the sampler lays the cache out) and its
own heads (over `tensor`); the cache, shared by the heads, is not split further.
(`check_vma=False`: a pallas_call's outputs carry no record of the axes they vary over.)
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _mesh_axes(logical: str, mesh) -> tuple[str, ...]:
  """The mesh axes of more than one device that the current rules give `logical`."""
  entry = nn.logical_to_mesh_axes((logical,))[0]
  axes = () if entry is None else (tuple(entry) if isinstance(entry, (tuple, list)) else (entry,))
  return tuple(a for a in axes if mesh.shape[a] > 1)


def _devices(axes: tuple[str, ...], mesh) -> int:
  """The devices along `axes`: the product of their sizes."""
  return math.prod(mesh.shape[a] for a in axes)


def _heads_axes(logical: tuple[str, ...], heads: int, mesh, what: str) -> tuple[str, ...]:
  """The mesh axes the heads split over (those of `logical`), checked to divide `heads`."""
  axes = sum((_mesh_axes(name, mesh) for name in logical), ())
  split = _devices(axes, mesh)
  if heads % split:
    raise ValueError(f"{what}: {heads} heads do not divide over the mesh axes {axes} ({split} devices)")
  return axes


def _max_logits_over(batch: tuple[str, ...], attention):
  """`attention` -> (out, max_logits [h]) with the per-head max logit taken over the batch axes
  (each device saw only its own rows)."""
  def local(*args):
    out, max_logits = attention(*args)
    return out, jax.lax.pmax(max_logits, batch) if batch else max_logits
  return local


def head_split_attention(attention, q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                         segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """`attention(q, k, v, scale, segment_ids) -> (out, max_logits [h])` per device, rows whole and
  heads split over `sequence` × `tensor` (module docstring). q, k: [b, s, h, d_qk]; v: [b, s, h, d_v];
  segment_ids [b, s] (None: one segment). Returns (out [b, s, h, d_v], max_logits [h] float32)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return attention(q, k, v, scale, segment_ids)
  batch = _mesh_axes("activation_batch", mesh)
  heads = _heads_axes(("activation_length", "activation_heads"), q.shape[2], mesh,
                      "sequence-parallel attention")
  seg = jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids
  rows = P(batch or None, None, heads or None, None)
  local = _max_logits_over(batch, lambda q, k, v, seg: attention(q, k, v, scale, seg))
  return jax.shard_map(local, in_specs=(rows, rows, rows, P(batch or None, None)),
                       out_specs=(rows, P(heads or None)), check_vma=False)(q, k, v, seg)


def vision_head_split_attention(attention, q: jax.Array, k: jax.Array, v: jax.Array,
                                segment_ids: jax.Array) -> jax.Array:
  """`attention(q, k, v, segment_ids) -> out` per device on the whole packed sequence of its own
  heads (module docstring): q, k, v [N, h, d] split P(None, tensor), segment_ids [N]. Returns
  out [N, h, d_v]."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return attention(q, k, v, segment_ids)
  heads = _heads_axes(("activation_heads",), q.shape[1], mesh, "vision attention")
  patches = P(None, heads or None, None)
  return jax.shard_map(attention, in_specs=(patches, patches, patches, P(None)), out_specs=patches,
                       check_vma=False)(q, k, v, segment_ids)


def row_split_decode_attention(attention, q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array,
                               k_rope: jax.Array, positions: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
  """`attention(q_latent, q_rope, latent, k_rope, positions, scale) -> (out_latent, max_logits [h])`
  per device on its own rows of the latent cache (module docstring): the queries q_latent
  [b, t, h, c], q_rope [b, t, h, r] P(batch, None, tensor); the cache latent [b, S, c], k_rope
  [b, S, r] and positions [b, t] by rows alone, since every head reads the same cache.
  Returns (out_latent [b, t, h, c], max_logits [h] float32, the max over the batch axes)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return attention(q_latent, q_rope, latent, k_rope, positions, scale)
  batch = _mesh_axes("activation_batch", mesh)
  if q_latent.shape[0] % _devices(batch, mesh):
    raise ValueError(f"latent decode attention: {q_latent.shape[0]} rows do not divide over the batch axes "
                     f"{batch} ({_devices(batch, mesh)} devices)")
  heads = _heads_axes(("activation_heads",), q_latent.shape[2], mesh, "latent decode attention")
  queries = P(batch or None, None, heads or None, None)
  cache = P(batch or None, None, None)
  local = _max_logits_over(batch, lambda *args: attention(*args, scale))
  return jax.shard_map(local, in_specs=(queries, queries, cache, cache, P(batch or None, None)),
                       out_specs=(queries, P(heads or None)), check_vma=False)(
                           q_latent, q_rope, latent, k_rope, positions)


def token_split(kernel, per_token: tuple, whole: tuple = ()):
  """`kernel(*per_token, *whole)` per device on its own tokens (module docstring): each array of
  `per_token` [T, ...] split on T over the mesh axes the decoder's tokens lie on (the batch
  axes, then `sequence`, as the flattened [b·s] rows; the longest leading run of them whose
  devices divide T: a decode step's T = rows splits over the batch axes alone), each of
  `whole` whole on every device (gathered where sharded, as FSDP gathers a layer); every
  output split like the tokens."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return kernel(*per_token, *whole)
  axes = _mesh_axes("activation_batch", mesh) + _mesh_axes("activation_length", mesh)
  while axes and per_token[0].shape[0] % _devices(axes, mesh):
    axes = axes[:-1]
  if not axes:
    return kernel(*per_token, *whole)
  rows = P(axes)
  return jax.shard_map(kernel, in_specs=(rows,) * len(per_token) + (P(),) * len(whole), out_specs=rows,
                       check_vma=False)(*per_token, *whole)


def shard_axes(shards: int) -> tuple[str, ...] | None:
  """The mesh axes (of more than one device) of `activation_batch` that a vmap over `shards` data
  shards splits its axis over, as its `spmd_axis_name`; None without a mesh, or when they do
  not divide `shards`."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  axes = _mesh_axes("activation_batch", mesh)
  return axes if axes and shards % _devices(axes, mesh) == 0 else None
