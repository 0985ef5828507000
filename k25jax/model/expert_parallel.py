"""Expert parallelism: the routed experts with every token sent to the devices holding its experts.

The mesh axis `expert` (P devices) splits the E routed experts into P groups of
E_loc = E / P, and it is one of the batch axes, so it splits the tokens too. Per
device, with its T tokens and their top-k experts (A = T·k token-expert pairs):

  1. sort the pairs by expert, hence by destination device ⌊e / E_loc⌋;
  2. all-gather the per-expert counts over `expert` ([P, E] ints): every device then
     knows the size of every transfer;
  3. dispatch the rows x_t to their destinations:
       all_to_all          fixed slots: C = ⌈c·A / P⌉ rows per (source, destination) pair;
       ragged_all_to_all   each source's rows packed behind the previous sources' rows
                           in a receive buffer of R = ⌈c·A⌉ rows;
     pairs that find no room are dropped and counted (`overflow`);
  4. apply the local experts to the received rows (`k25jax.ops.moe.grouped_ffn`);
  5. send the results back the way they came and combine them in token order:
       y_t = Σ_j w_tj · FFN_{e_tj}(x_t)            (a dropped pair contributes 0).

c = `ModelConfig.ep_capacity_factor`: the buffers hold c times a device's fair share;
c = 0 sizes them for the worst case (every pair of every device sent to one device), so
nothing is ever dropped. Expert weights split along `embed` (FSDP) are all-gathered
inside, per layer; a `moe_mlp` split (tensor parallel) leaves partial sums, added by one
psum of y. `ragged_all_to_all` has no XLA:CPU kernel, so `ep_dispatch="auto"` takes it
on TPU/GPU and the fixed-slot all_to_all on CPU.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k25jax.model.config import ModelConfig
from k25jax.ops.moe import grouped_ffn

EXPERT_AXIS = "expert"
TOKEN_AXES = ("activation_batch", "activation_length", "activation_embed")
EXPERT_IN_AXES = ("exp", "embed", "moe_mlp")      # gate_proj, up_proj [E, d, f]
EXPERT_OUT_AXES = ("exp", "moe_mlp", "embed")     # down_proj [E, f, d]


def active(cfg: ModelConfig) -> bool:
  """True when `cfg.expert_parallel` and the current mesh's `expert` axis has > 1 device."""
  mesh = jax.sharding.get_abstract_mesh()
  return (cfg.expert_parallel and EXPERT_AXIS in mesh.axis_names
          and mesh.shape[EXPERT_AXIS] > 1)


def gathered_expert_bytes(cfg: ModelConfig) -> int:
  """Bytes of one MoE layer's routed experts (E · 3 · d · f in the compute dtype): what each
  device gathers for the layer when the experts are not split over an `expert` axis."""
  return (cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
          * jnp.dtype(cfg.dtype).itemsize)


def check_layout(cfg: ModelConfig, device_bytes: float | None) -> None:
  """Refuses (ValueError) a layout that leaves a large model's routed experts unsplit: without
  expert parallelism every device gathers all E experts of each MoE layer, and the dropless
  routing sorts all of a layer's token-expert pairs in one global array. Large means more
  than a quarter of `device_bytes` (None: unknown, e.g. a CPU, nothing checked)."""
  if active(cfg) or device_bytes is None or cfg.num_moe_layers == 0:
    return
  need = gathered_expert_bytes(cfg)
  if need > device_bytes / 4:
    raise ValueError(
        f"no expert parallelism: every device would gather all {cfg.n_routed_experts} routed experts of each MoE "
        f"layer ({need / 1e9:.1f} GB in {cfg.dtype}, more than a quarter of its {device_bytes / 1e9:.0f} GB) and "
        f"sort the layer's token-expert pairs of the whole batch in one array; split the experts over an "
        f"`{EXPERT_AXIS}` mesh axis (mesh.{EXPERT_AXIS} dividing {cfg.n_routed_experts}, e.g. 64: "
        f"{cfg.n_routed_experts // 64 if cfg.n_routed_experts % 64 == 0 else 'some'} experts a device)")


def dispatch_mode(cfg: ModelConfig) -> str:
  """"all_to_all" | "ragged_all_to_all" ("auto": ragged when running on TPU/GPU)."""
  if cfg.ep_dispatch == "auto":
    return "ragged_all_to_all" if jax.default_backend() in ("tpu", "gpu") else "all_to_all"
  return cfg.ep_dispatch


def buffer_rows(n_tokens: int, top_k: int, n_shards: int, local_experts: int, capacity_factor: float,
                dispatch: str) -> int:
  """Rows of one (source, destination) slot (all_to_all) or of the receive buffer (ragged).

  A source sends one destination at most T·min(k, E_loc) rows (a token's k experts are
  distinct); the receive buffer gets at most P times that.
  """
  worst = n_tokens * min(top_k, local_experts) * (1 if dispatch == "all_to_all" else n_shards)
  share = n_tokens * top_k / (n_shards if dispatch == "all_to_all" else 1)
  return worst if capacity_factor == 0 else max(1, min(worst, math.ceil(capacity_factor * share)))


def _axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _without_single_device_axes(spec: P, mesh) -> P:
  """`spec` with the mesh axes of size 1 left out (no collective is then emitted over them)."""
  entries = [tuple(a for a in _axes(e) if mesh.shape[a] > 1) for e in spec]
  return P(*(e if len(e) > 1 else (e[0] if e else None) for e in entries))


def _row_groups(seg_start: jax.Array, seg_size: jax.Array, n_rows: int, local_experts: int) -> jax.Array:
  """Local expert of each received row (local_experts for an empty slot).

  seg_start, seg_size: [P, E_loc], where the rows of (source, local expert) lie in the
  receive buffer; segments are in increasing order of start.
  """
  starts, ends = seg_start.reshape(-1), (seg_start + seg_size).reshape(-1)
  rows = jnp.arange(n_rows)
  segment = jnp.maximum(jnp.searchsorted(starts, rows, side="right") - 1, 0)
  return jnp.where(rows < ends[segment], segment % local_experts, local_experts).astype(jnp.int32)


def _exchange_all_to_all(rows_sorted, dest, rank, kept, arrived, slot_rows, ffn):
  """Fixed-slot dispatch: slot (destination j, rank r) of the send buffer [P, C, d]."""
  n_shards, local_experts = arrived.shape
  d = rows_sorted.shape[-1]
  slot = jnp.where(kept, dest * slot_rows + rank, n_shards * slot_rows)
  send = jnp.zeros((n_shards * slot_rows + 1, d), rows_sorted.dtype).at[slot].set(rows_sorted)
  recv = jax.lax.all_to_all(send[:-1].reshape(n_shards, slot_rows, d), EXPERT_AXIS, 0, 0)
  seg_start = (jnp.arange(n_shards)[:, None] * slot_rows + jnp.cumsum(arrived, -1) - arrived)
  groups = _row_groups(seg_start, arrived, n_shards * slot_rows, local_experts)
  y_recv = ffn(recv.reshape(n_shards * slot_rows, d), groups)
  back = jax.lax.all_to_all(y_recv.reshape(n_shards, slot_rows, d), EXPERT_AXIS, 0, 0)
  back = jnp.concatenate([back.reshape(n_shards * slot_rows, d), jnp.zeros((1, d), back.dtype)])
  return back[slot]


def _exchange_ragged(rows_sorted, kept, pair, allowed, before, arrived, recv_rows, ffn, ragged_all_to_all):
  """Packed dispatch: source i's rows land at before[i, me] of the receive buffer [R, d]."""
  me = jax.lax.axis_index(EXPERT_AXIS)
  local_experts = arrived.shape[1]
  d = rows_sorted.shape[-1]
  start = jnp.cumsum(pair, axis=1) - pair              # [source, destination]: chunk start in the source's rows
  sent, got = allowed[me], allowed[:, me]
  nonzero = lambda offsets, sizes: jnp.where(sizes > 0, offsets, 0).astype(jnp.int32)
  recv = ragged_all_to_all(rows_sorted, jnp.zeros((recv_rows, d), rows_sorted.dtype),
                           nonzero(start[me], sent), sent, nonzero(before[me], sent), got,
                           axis_name=EXPERT_AXIS)
  seg_start = before[:, me][:, None] + jnp.cumsum(arrived, -1) - arrived
  y_recv = ffn(recv, _row_groups(seg_start, arrived, recv_rows, local_experts))
  back = ragged_all_to_all(y_recv, jnp.zeros(rows_sorted.shape, y_recv.dtype),
                           nonzero(before[:, me], got), got, nonzero(start[:, me], got), sent,
                           axis_name=EXPERT_AXIS)
  return jnp.where(kept[:, None], back, 0)


def routed_experts(x, experts, weights, gate, up, down, *, token_spec: P, in_spec: P, out_spec: P,
                   dispatch: str, capacity_factor: float, use_ragged_dot: bool = False, block: int = 0,
                   ragged_all_to_all=jax.lax.ragged_all_to_all):
  """Σ_j w_tj · FFN_{e_tj}(x_t) with the experts split over the mesh's `expert` axis.

  x: [b, s, d]; experts, weights: [b, s, k], laid out by `token_spec` (which must split
  the batch over `expert`); gate, up: [E, d, f] laid out by `in_spec`, down: [E, f, d]
  by `out_spec` (both split E over `expert`). Call under `jax.set_mesh`. Returns
  (y [b, s, d] float32, overflow: int32, the pairs dropped on all devices).
  """
  mesh = jax.sharding.get_abstract_mesh()
  token_spec, in_spec, out_spec = (_without_single_device_axes(s, mesh) for s in (token_spec, in_spec, out_spec))
  if _axes(in_spec[0]) != (EXPERT_AXIS,) or _axes(out_spec[0]) != (EXPERT_AXIS,):
    raise ValueError(f"expert parallelism: the expert dimension of the expert weights must be split over "
                     f"exactly the '{EXPERT_AXIS}' mesh axis, got {in_spec} / {out_spec}")
  token_axes = _axes(token_spec[0]) + _axes(token_spec[1])
  if EXPERT_AXIS not in _axes(token_spec[0]) or _axes(token_spec[2]):
    raise ValueError(f"expert parallelism: the tokens must be split over '{EXPERT_AXIS}' along the batch "
                     f"and not along the hidden dimension, got {token_spec} (apply the model under "
                     "nn.logical_axis_rules(k25jax.train.sharding.RULES) as the train step does, or set "
                     "ModelConfig.expert_parallel=False)")
  embed_axes, mlp_axes = _axes(in_spec[1]), _axes(in_spec[2])
  if (embed_axes, mlp_axes) != (_axes(out_spec[2]), _axes(out_spec[1])):
    raise ValueError(f"expert parallelism: gate/up {in_spec} and down {out_spec} must split embed and "
                     "moe_mlp the same way")
  batch, seq, _ = x.shape
  n_shards = mesh.shape[EXPERT_AXIS]
  for dim, size, entry in ((0, batch, token_spec[0]), (1, seq, token_spec[1])):
    split = math.prod(mesh.shape[a] for a in _axes(entry))
    if size % split:
      raise ValueError(f"expert parallelism: tokens dimension {dim} ({size}) must divide over the mesh axes "
                       f"{_axes(entry)} ({split} devices)")
  n_tokens = batch * seq // math.prod(mesh.shape[a] for a in token_axes)
  top_k, local_experts = experts.shape[-1], gate.shape[0] // n_shards
  if gate.shape[0] % n_shards:
    raise ValueError(f"expert parallelism: {gate.shape[0]} experts do not divide over {n_shards} devices")
  rows = buffer_rows(n_tokens, top_k, n_shards, local_experts, capacity_factor, dispatch)

  def local(x, experts, weights, gate, up, down):
    d = x.shape[-1]
    if embed_axes:
      gate, up = (jax.lax.all_gather(w, embed_axes, axis=1, tiled=True) for w in (gate, up))
      down = jax.lax.all_gather(down, embed_axes, axis=2, tiled=True)
    ffn = lambda r, g: grouped_ffn(r, g, gate, up, down, use_ragged_dot=use_ragged_dot, block=block)
    me = jax.lax.axis_index(EXPERT_AXIS)
    flat = experts.reshape(-1).astype(jnp.int32)
    n_pairs = flat.shape[0]
    order = jnp.argsort(flat, stable=True)
    dest = flat[order] // local_experts
    counts = jax.lax.all_gather(jnp.bincount(flat, length=n_shards * local_experts), EXPERT_AXIS)
    per_expert = counts.reshape(n_shards, n_shards, local_experts).astype(jnp.int32)  # [src, dst, e]
    pair = per_expert.sum(-1)                                                        # [src, dst]
    before = jnp.cumsum(pair, axis=0) - pair     # rows of earlier sources for the same destination
    allowed = (jnp.minimum(pair, rows) if dispatch == "all_to_all"
               else jnp.clip(rows - before, 0, pair))
    rank = jnp.arange(n_pairs) - (jnp.cumsum(pair[me]) - pair[me])[dest]
    kept = rank < allowed[me][dest]
    seg = per_expert[:, me, :]                                                       # [src, e]
    arrived = jnp.clip(allowed[:, me][:, None] - (jnp.cumsum(seg, -1) - seg), 0, seg)
    rows_sorted = x.reshape(-1, d)[order // top_k]
    if dispatch == "all_to_all":
      y_sorted = _exchange_all_to_all(rows_sorted, dest, rank, kept, arrived, rows, ffn)
    else:
      y_sorted = _exchange_ragged(rows_sorted, kept, pair, allowed, before, arrived, rows, ffn,
                                  ragged_all_to_all)
    y_pairs = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(-1, top_k, d)
    y = jnp.einsum("tkd,tk->td", y_pairs.astype(jnp.float32), weights.reshape(-1, top_k).astype(jnp.float32))
    if mlp_axes:
      y = jax.lax.psum(y, mlp_axes)
    overflow = jax.lax.psum(n_pairs - jnp.sum(kept, dtype=jnp.int32), token_axes)
    return y.reshape(x.shape[:-1] + (d,)), overflow

  return jax.shard_map(local, in_specs=(token_spec, token_spec, token_spec, in_spec, in_spec, out_spec),
                       out_specs=(token_spec, P()))(x, experts, weights, gate, up, down)


def sharded_experts(cfg: ModelConfig, x, experts, weights, gate, up, down):
  """`routed_experts` with the layouts of the current logical-axis rules and the config's dispatch."""
  return routed_experts(
      x, experts, weights, gate, up, down, token_spec=nn.logical_to_mesh_axes(TOKEN_AXES),
      in_spec=nn.logical_to_mesh_axes(EXPERT_IN_AXES), out_spec=nn.logical_to_mesh_axes(EXPERT_OUT_AXES),
      dispatch=dispatch_mode(cfg), capacity_factor=cfg.ep_capacity_factor,
      use_ragged_dot=cfg.moe_impl == "ragged_dot", block=cfg.moe_block_size)
