"""MoE routing and routed-expert compute in plain jax.numpy (no parameters, no Flax).

Router (DeepSeek-V3 `noaux_tc`, `route`), per token with router logits z:

    s        = sigmoid(z)                               (float32)
    choice   = s + b                                    (b = e_score_correction_bias, no gradient)
    groups   : score of group g = sum of its top-2 `choice`; keep the top `topk_group` groups
    K        = top-k experts of `choice` among kept groups
    w_e      = routed_scaling_factor · s_e / (Σ_{e'∈K} s_e' + 1e-20)   for e ∈ K

Routed experts, y_t = Σ_{e∈K} w_e · FFN_e(x_t) with FFN_e(x) = down_e(silu(x·gate_e) ⊙ x·up_e),
computed three ways that agree:
* `experts_dense`       every expert on every token (the reference);
* `experts_ragged`      dropless: tokens sorted by expert into tiles of `block` rows
                        (`tile_layout`, `auto_block_size`), one batched matmul over tiles
                        (`experts_ragged_or_dense`, the model's "ragged": dense where a
                        few tokens make the tiles cost more);
* `experts_ragged_dot`  dropless with `jax.lax.ragged_dot` on expert-sorted rows (`sort_by_expert`).
`grouped_ffn` applies the FFNs to rows already labelled by expert (expert parallelism).

The model's MoE layer (`k25jax.model.moe`), expert parallelism and the references of the
Pallas MoE kernels (`pallas_kernels.moe`) use these.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


# ----------------------------------------------------------------------------- router
def route(logits: jax.Array, bias: jax.Array, *, top_k: int, n_group: int, topk_group: int,
          norm_topk_prob: bool, routed_scaling_factor: float
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """noaux_tc routing. logits: [tokens, E] float32 → (weights [T, k], experts [T, k], s [T, E])."""
  scores = jax.nn.sigmoid(logits.astype(jnp.float32))
  choice = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
  n_tokens, n_experts = scores.shape
  if n_group > 1 and topk_group < n_group:
    grouped = choice.reshape(n_tokens, n_group, n_experts // n_group)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)                     # [T, G]
    _, kept = jax.lax.top_k(group_scores, topk_group)                       # [T, topk_group]
    group_mask = jnp.zeros((n_tokens, n_group), bool).at[jnp.arange(n_tokens)[:, None], kept].set(True)
    expert_mask = jnp.repeat(group_mask, n_experts // n_group, axis=1)
    choice = jnp.where(expert_mask, choice, -jnp.inf)
  _, experts = jax.lax.top_k(jax.lax.stop_gradient(choice), top_k)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
  return weights * routed_scaling_factor, experts, scores


# ------------------------------------------------------------------ expert compute paths
def experts_dense(x, experts, weights, gate, up, down):
  """Every expert on every token: y_t = Σ_e w_{t,e} FFN_e(x_t) with w = 0 off the top-k.

  The gate and up products are batched over experts, reading each [d, f] kernel where it
  lies (contracting d of [E, d, f] as one matmul would copy a transposed [d, E·f] kernel
  first, at every decode step). The routing weight scales each expert's hidden before the
  down projection, y_t = Σ_{e,f} (w_{t,e} · h_{e,t,f}) · down_{e,f,:}, one contraction
  over (e, f) with no [T, E, d] intermediate.
  """
  n_experts = gate.shape[0]
  dense_w = (jax.nn.one_hot(experts, n_experts, dtype=jnp.float32) * weights[..., None]).sum(1)
  xe = jnp.broadcast_to(x, (n_experts,) + x.shape)          # batched over experts: gate, up unmoved
  h = jax.nn.silu(jnp.einsum("etd,edf->etf", xe, gate)) * jnp.einsum("etd,edf->etf", xe, up)  # [E, T, f]
  weighted = (h.astype(jnp.float32) * dense_w.T[..., None]).astype(down.dtype)
  return jnp.einsum("etf,efd->td", weighted, down, preferred_element_type=jnp.float32)


def sort_by_expert(experts: jax.Array, n_experts: int):
  """Assignments (token t, slot j) ↦ a = t·k + j, stably sorted by expert.

  Returns (order [A]: assignment at each sorted position, group_sizes [E] int32).
  """
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
  return order, group_sizes


def auto_block_size(n_assignments: int, n_experts: int, max_block: int = 128) -> int:
  """Largest power of two ≤ max_block whose worst-case tile padding stays ≤ 1/8 of the work."""
  block = max_block
  while block > 1 and min(n_experts, n_assignments) * (block - 1) * 8 > n_assignments:
    block //= 2
  return block


def padded_rows(n: int, n_groups: int, block: int) -> int:
  """Slots of `tile_layout`: n + min(n_groups, n)·(block−1), rounded up to whole tiles."""
  return -(-(n + min(n_groups, n) * (block - 1)) // block) * block


def tile_layout(groups: jax.Array, n_groups: int, block: int):
  """Rows sorted by group into tiles of `block` rows, each tile holding one group's rows.

  groups: [N] ints; rows with a group ≥ n_groups are left out. Each group's rows are
  padded to a multiple of `block`, so there are n_rows = N + min(n_groups, N)·(block−1)
  slots (rounded up to whole tiles). Returns (source [n_rows]: the row in each slot, N
  for padding; slot [N]: each row's slot, n_rows for rows left out; tile_group [tiles]).
  """
  n = groups.shape[0]
  order = jnp.argsort(groups, stable=True)
  sorted_group = groups[order]
  sizes = jnp.bincount(groups, length=n_groups).astype(jnp.int32)        # groups ≥ n_groups not counted
  padded_sizes = (sizes + block - 1) // block * block
  padded_end = jnp.cumsum(padded_sizes)
  padded_start = padded_end - padded_sizes
  group_start = jnp.cumsum(sizes) - sizes
  n_rows = padded_rows(n, n_groups, block)
  kept = sorted_group < n_groups
  g = jnp.minimum(sorted_group, n_groups - 1)
  dest = jnp.where(kept, padded_start[g] + jnp.arange(n) - group_start[g], n_rows).astype(jnp.int32)
  source = jnp.full((n_rows,), n, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
  slot = jnp.zeros((n,), jnp.int32).at[order].set(dest)
  tile_group = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(n_rows // block) * block, side="right"),
                           n_groups - 1)
  return source, slot, tile_group


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def take_rows(x: jax.Array, index: jax.Array, transpose_index: jax.Array, fold: int) -> jax.Array:
  """y_i = x_{index_i} (0 where index_i ≥ N) for x [N, d], index [M]; a permutation of rows
  whose transpose is also a gather:

      dx_n = Σ_{j<fold} dy_{transpose_index[n·fold + j]}   (0 where the index is ≥ M)

  `transpose_index` [N·fold] must list, for each row n of x, the `fold` entries of y that
  read it. Autodiff would transpose the gather into a scatter-add into a fresh zeroed
  [N, d] buffer; the tile layout knows both directions (`tile_layout`'s source and slot).
  """
  return _take(x, index)


def _take(x, index):
  padded = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)], axis=0)
  return padded[jnp.minimum(index, x.shape[0])]


def _take_rows_fwd(x, index, transpose_index, fold):
  return _take(x, index), (transpose_index, x[:0])       # x[:0]: x's type, no data


def _take_rows_bwd(fold, saved, dy):
  transpose_index, x_type = saved
  n = transpose_index.shape[0] // fold
  dx = _take(dy, transpose_index).reshape((n, fold) + dy.shape[1:]).sum(1)
  return _summed_like(dx, x_type), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _combine(y: jax.Array, weights: jax.Array) -> jax.Array:
  """Σ_j w_{t,j} y_{t,j,:} for y [T, k, d], weights [T, k], in float32 (elementwise and a
  reduction: as an einsum XLA:CPU runs it as T tiny batched dots, forward and backward)."""
  return jnp.sum(y.astype(jnp.float32) * weights[..., None].astype(jnp.float32), axis=1)


@jax.custom_vjp
def _tiled_swiglu(tiles, tile_group, gate, up, down):
  """[tiles, block, d] rows through the FFN of each tile's group: y = (silu(x·G) ⊙ x·U)·D
  with G, U, D the tile's group's gate, up and down kernels.

  gate and up are gathered as one [tiles, d, 2f] kernel, so x·gate and x·up are one
  batched product of twice the width (forward and backward: 180 → 139 ms for the
  reference config's routed experts). The backward is written out (`_tiled_swiglu_bwd`)
  and gathers the kernels again, so the forward pass keeps only the rows and h = x·[G U],
  not the gathered kernels (54 MB a layer at the reference config).
  """
  return _tiled_swiglu_fwd(tiles, tile_group, gate, up, down)[0]


def _tile_kernels(tile_group, gate, up, down):
  """Each tile's [G U] ([tiles, d, 2f]) and D ([tiles, f, d])."""
  return jnp.concatenate([gate, up], axis=-1)[tile_group], down[tile_group]


def _tiled_swiglu_fwd(tiles, tile_group, gate, up, down):
  gate_up, tile_down = _tile_kernels(tile_group, gate, up, down)
  h = jnp.einsum("nbd,ndf->nbf", tiles, gate_up)
  h_gate, h_up = jnp.split(h, 2, axis=-1)
  y = jnp.einsum("nbf,nfd->nbd", jax.nn.silu(h_gate) * h_up, tile_down)
  return y, (tiles, tile_group, h, gate, up, down)


def _tiled_swiglu_bwd(saved, dy):
  """With a = silu(h_G) ⊙ h_U and σ = sigmoid(h_G):

      dD_tile = aᵀ dy,   da = dy Dᵀ,   dh_U = da ⊙ silu(h_G),   dh_G = da ⊙ h_U ⊙ σ(1 + h_G(1 − σ)),
      dx = [dh_G dh_U]·[G U]ᵀ,   d[G U]_tile = xᵀ [dh_G dh_U],

  the per-tile kernel gradients summed into their groups. The kernels are gathered anew, and
  a recomputed, from kernels + 0·dy₀ and h + 0·dy₀: depending on the cotangent, they are
  formed in this layer's backward and not earlier (XLA would otherwise schedule the gathers
  early or merge them and a with the forward's, keeping them alive across the layers between).
  """
  tiles, tile_group, h, gate, up, down = saved
  after_dy = (dy.reshape(-1)[0] * 0).astype(gate.dtype)
  gate_up, tile_down = _tile_kernels(tile_group, gate + after_dy, up + after_dy, down + after_dy)
  h_gate, h_up = jnp.split(h + after_dy.astype(h.dtype), 2, axis=-1)
  sig = jax.nn.sigmoid(h_gate)
  silu = h_gate * sig
  d_tile_down = jnp.einsum("nbf,nbd->nfd", silu * h_up, dy)
  d_act = jnp.einsum("nbd,nfd->nbf", dy, tile_down)
  dh = jnp.concatenate([d_act * h_up * sig * (1 + h_gate * (1 - sig)), d_act * silu], axis=-1)
  d_tiles = jnp.einsum("nbf,ndf->nbd", dh, gate_up)
  d_gate_up = jnp.zeros((gate.shape[0],) + gate_up.shape[1:], jnp.float32).at[tile_group].add(
      jnp.einsum("nbd,nbf->ndf", tiles, dh, preferred_element_type=jnp.float32))
  d_down = jnp.zeros(down.shape, jnp.float32).at[tile_group].add(d_tile_down.astype(jnp.float32))
  d_gate, d_up = jnp.split(d_gate_up, 2, axis=-1)
  return (_summed_like(d_tiles, tiles), None, _summed_like(d_gate, gate), _summed_like(d_up, up),
          _summed_like(d_down, down))


def _summed_like(grad: jax.Array, primal: jax.Array) -> jax.Array:
  """grad summed over the manual mesh axes it varies over and its primal does not, in the
  primal's dtype: inside a shard_map, the kernels' gradient from each data shard's tokens and
  the rows' gradient from each tensor shard's part of f (what autodiff's transpose of the
  implicit broadcasts does); a no-op elsewhere."""
  varying = lambda x: jax.typeof(x).manual_axis_type.varying
  extra = tuple(sorted(varying(grad) - varying(primal)))
  return (jax.lax.psum(grad, extra) if extra else grad).astype(primal.dtype)


_tiled_swiglu.defvjp(_tiled_swiglu_fwd, _tiled_swiglu_bwd)


# Flops one weight number costs to move (read or write), against computing with it: a CPU or
# accelerator core computes ~100 flops in the time one float32 crosses memory.
FLOPS_PER_MOVED_NUMBER = 100


def tiles_cost_more_than_dense(n_tokens: int, top_k: int, n_experts: int, block: int) -> bool:
  """Whether the tile layout costs more than every expert on every token, in units of one
  expert's 3·d·f weights (a roofline count, flops with moves weighted by μ = 100):

      tiles: 2·μ·n_tiles (each tile's weights gathered: written, read) + 2·n_rows
      dense: μ·E (every expert's weights read once)                       + 2·T·E

  Few tokens (decode: block 1, one gathered weight copy per assignment) favour dense;
  training batches favour tiles (reference config: 65.7K against 132.7K)."""
  n_assignments = n_tokens * top_k
  n_rows = padded_rows(n_assignments, n_experts, block)
  tiles = 2 * FLOPS_PER_MOVED_NUMBER * (n_rows // block) + 2 * n_rows
  dense = FLOPS_PER_MOVED_NUMBER * n_experts + 2 * n_tokens * n_experts
  return tiles > dense


def experts_ragged_or_dense(x, experts, weights, gate, up, down, block: int = 0):
  """`experts_ragged`, or `experts_dense` where the tiles cost more (`tiles_cost_more_than_dense`:
  a few tokens, as in decoding); the result is the same."""
  n_tokens, top_k = experts.shape
  block = block or auto_block_size(n_tokens * top_k, gate.shape[0])
  if tiles_cost_more_than_dense(n_tokens, top_k, gate.shape[0], block):
    return experts_dense(x, experts, weights, gate, up, down)
  return experts_ragged(x, experts, weights, gate, up, down, block)


def experts_ragged(x, experts, weights, gate, up, down, block: int = 0):
  """Dropless expert compute over expert-sorted tiles (pays only for routed tokens).

  Each expert's assignments are padded to a multiple of `block` rows; tile n
  (rows n·block … n·block+block−1) belongs to one expert, so the layer is one
  batched matmul [tiles, block, d] × [tiles, d, f]. Rows: A + min(E, A)·(block−1).
  """
  n_tokens, top_k = experts.shape
  n_experts, d = gate.shape[0], x.shape[-1]
  block = block or auto_block_size(n_tokens * top_k, n_experts)
  source, slot, tile_group = tile_layout(experts.reshape(-1), n_experts, block)
  token = jnp.where(source < n_tokens * top_k, source // top_k, n_tokens)          # N: padding
  rows = take_rows(x, token, slot, top_k).reshape(-1, block, d)
  y_rows = _tiled_swiglu(rows, tile_group, gate, up, down).reshape(-1, d)
  return _combine(take_rows(y_rows, slot, source, 1).reshape(n_tokens, top_k, d), weights)


def grouped_ffn(rows, groups, gate, up, down, *, use_ragged_dot: bool = False, block: int = 0):
  """y_r = FFN_{groups_r}(rows_r) for rows [N, d], 0 where groups_r ≥ E (empty slots).

  Over tiles as `experts_ragged`, or with `jax.lax.ragged_dot` on the rows sorted by
  group (TPU/GPU's grouped matmul; a masked dense product on CPU).
  """
  n_rows, d = rows.shape
  n_groups = gate.shape[0]
  if use_ragged_dot:
    order = jnp.argsort(groups, stable=True)
    sizes = jnp.bincount(groups, length=n_groups).astype(jnp.int32)      # left-out rows sort last
    x = rows[order]
    h = jax.nn.silu(jax.lax.ragged_dot(x, gate, sizes)) * jax.lax.ragged_dot(x, up, sizes)
    return jnp.zeros((n_rows, d), rows.dtype).at[order].set(jax.lax.ragged_dot(h, down, sizes))
  block = block or auto_block_size(n_rows, n_groups)
  source, slot, tile_group = tile_layout(groups, n_groups, block)
  y_tiles = _tiled_swiglu(take_rows(rows, source, slot, 1).reshape(-1, block, d), tile_group, gate, up, down)
  return take_rows(y_tiles.reshape(-1, d), slot, source, 1)


def experts_ragged_dot(x, experts, weights, gate, up, down):
  """Dropless expert compute with `jax.lax.ragged_dot` on expert-sorted rows."""
  n_tokens, top_k = experts.shape
  order, group_sizes = sort_by_expert(experts, gate.shape[0])
  rows = x[order // top_k]
  h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, group_sizes)) * jax.lax.ragged_dot(rows, up, group_sizes)
  y_sorted = jax.lax.ragged_dot(h, down, group_sizes)
  y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n_tokens, top_k, -1)
  return _combine(y, weights)
