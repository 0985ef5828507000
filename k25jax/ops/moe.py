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


def _tiled_swiglu(tiles, tile_group, gate, up, down):
  """[tiles, block, d] rows through the FFN of each tile's group.

  gate and up are gathered as one [tiles, d, 2f] kernel, so x·gate and x·up are one
  batched product of twice the width (forward and backward: 180 → 139 ms for the
  reference config's routed experts)."""
  gate_up = jnp.concatenate([gate, up], axis=-1)[tile_group]
  h_gate, h_up = jnp.split(jnp.einsum("nbd,ndf->nbf", tiles, gate_up), 2, axis=-1)
  return jnp.einsum("nbf,nfd->nbd", jax.nn.silu(h_gate) * h_up, down[tile_group])


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
  x_padded = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)], axis=0)
  rows = x_padded[jnp.minimum(source // top_k, n_tokens)].reshape(-1, block, d)
  y_rows = _tiled_swiglu(rows, tile_group, gate, up, down)
  y = y_rows.reshape(-1, d)[slot].reshape(n_tokens, top_k, d)
  return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), weights)


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
  padded = jnp.concatenate([rows, jnp.zeros((1, d), rows.dtype)], axis=0)
  y_tiles = _tiled_swiglu(padded[source].reshape(-1, block, d), tile_group, gate, up, down)
  return jnp.concatenate([y_tiles.reshape(-1, d), jnp.zeros((1, d), y_tiles.dtype)], axis=0)[slot]


def experts_ragged_dot(x, experts, weights, gate, up, down):
  """Dropless expert compute with `jax.lax.ragged_dot` on expert-sorted rows."""
  n_tokens, top_k = experts.shape
  order, group_sizes = sort_by_expert(experts, gate.shape[0])
  rows = x[order // top_k]
  h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, group_sizes)) * jax.lax.ragged_dot(rows, up, group_sizes)
  y_sorted = jax.lax.ragged_dot(h, down, group_sizes)
  y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n_tokens, top_k, -1)
  return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), weights)
