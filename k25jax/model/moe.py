"""The K2 MoE layer: `noaux_tc` router, SwiGLU routed experts, ungated shared expert.

Router (DeepSeek-V3 `noaux_tc`), per token with hidden state x:

    s        = sigmoid(x · W_gate)                      (float32)
    choice   = s + b                                    (b = e_score_correction_bias, no gradient)
    groups   : score of group g = sum of its top-2 `choice`; keep the top `topk_group` groups
    K        = top-k experts of `choice` among kept groups
    w_e      = routed_scaling_factor · s_e / (Σ_{e'∈K} s_e' + 1e-20)   for e ∈ K

    y = Σ_{e∈K} w_e · FFN_e(x) + FFN_shared(x)

Bias balancing (the train step calls `update_router_bias` after each step):
    b ← b + γ · sign(mean(load) − load).

Expert compute paths (`ModelConfig.moe_impl`), all equal to each other:
* ``dense``      every expert on every token (the reference; pays E/k × the flops);
* ``ragged``     dropless: tokens sorted by expert into tiles of `block` rows, one
                 batched matmul over tiles (pays only for routed tokens + tile padding,
                 on every backend, CPU included);
* ``ragged_dot`` dropless with `jax.lax.ragged_dot` (native on TPU/GPU; a masked
                 dense product on CPU);
* ``pallas``     the Pallas routing kernel, expert sort and grouped matmul
                 (`pallas_kernels.moe`; compiled on TPU/GPU, interpreted on CPU).

Expert parallelism (`k25jax.model.expert_parallel`): when the mesh's `expert` axis has
more than one device, tokens travel by all-to-all to the devices holding their experts,
which run `grouped_ffn` (tiles, or `ragged_dot` with moe_impl="ragged_dot") on what
they receive.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k25jax.model.config import ModelConfig
from k25jax.model.layers import MLP, dtype_of, normal_init

ROUTER_BIAS = "e_score_correction_bias"


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


def expert_load(experts: jax.Array, n_experts: int, token_mask: jax.Array | None = None) -> jax.Array:
  """Tokens routed to each expert, [E] float32 (masked tokens excluded). experts: [T, k]."""
  one_hot = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32).sum(1)   # [T, E]
  if token_mask is not None:
    one_hot = one_hot * token_mask.reshape(-1, 1).astype(jnp.float32)
  return one_hot.sum(0)


def update_router_bias(bias: jax.Array, load: jax.Array, gamma: float) -> jax.Array:
  """Auxiliary-loss-free balancing: b + γ · sign(mean(load) − load)."""
  return bias + gamma * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load).astype(bias.dtype)


def sequence_balance_loss(scores: jax.Array, experts: jax.Array, token_mask: jax.Array) -> jax.Array:
  """DeepSeek-V3 sequence-wise balance loss (without α), averaged over sequences.

      L = Σ_i f_i · P_i,  f_i = E/(k·T) Σ_t 1[i ∈ K_t],  P_i = 1/T Σ_t s_{i,t} / Σ_j s_{j,t}

  scores: [B, S, E]; experts: [B, S, k]; token_mask: [B, S] (T counts unmasked tokens).
  """
  n_experts, top_k = scores.shape[-1], experts.shape[-1]
  mask = token_mask.astype(jnp.float32)[..., None]
  n_tok = jnp.maximum(mask.sum(1), 1.0)                                    # [B, 1]
  hits = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32).sum(2) * mask
  f = hits.sum(1) * n_experts / (top_k * n_tok)
  p = (scores / scores.sum(-1, keepdims=True) * mask).sum(1) / n_tok
  return jnp.mean(jnp.sum(f * p, axis=-1))


# ------------------------------------------------------------------ expert compute paths
def _swiglu(x, gate, up, down, in_spec: str, out_spec: str):
  """down(silu(x·gate) ⊙ x·up), batched by the einsum specs of the up and down products."""
  h = jax.nn.silu(jnp.einsum(in_spec, x, gate)) * jnp.einsum(in_spec, x, up)
  return jnp.einsum(out_spec, h, down)


def experts_dense(x, experts, weights, gate, up, down):
  """Every expert on every token: y_t = Σ_e w_{t,e} FFN_e(x_t) with w = 0 off the top-k."""
  n_experts = gate.shape[0]
  dense_w = (jax.nn.one_hot(experts, n_experts, dtype=jnp.float32) * weights[..., None]).sum(1)
  y = _swiglu(x, gate, up, down, "td,edf->tef", "tef,efd->ted")                           # [T, E, d]
  return jnp.einsum("ted,te->td", y.astype(jnp.float32), dense_w)


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
  n_rows = -(-(n + min(n_groups, n) * (block - 1)) // block) * block
  kept = sorted_group < n_groups
  g = jnp.minimum(sorted_group, n_groups - 1)
  dest = jnp.where(kept, padded_start[g] + jnp.arange(n) - group_start[g], n_rows).astype(jnp.int32)
  source = jnp.full((n_rows,), n, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
  slot = jnp.zeros((n,), jnp.int32).at[order].set(dest)
  tile_group = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(n_rows // block) * block, side="right"),
                           n_groups - 1)
  return source, slot, tile_group


def _tiled_swiglu(tiles, tile_group, gate, up, down):
  """[tiles, block, d] rows through the FFN of each tile's group."""
  return _swiglu(tiles, gate[tile_group], up[tile_group], down[tile_group], "nbd,ndf->nbf", "nbf,nfd->nbd")


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


# ----------------------------------------------------------------------------- modules
class Router(nn.Module):
  """The `gate` of the checkpoint: kernel [d, E] (float32) and the selection bias [E]."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array):
    cfg = self.cfg
    n_exp = cfg.n_routed_experts
    kernel = self.param("kernel", nn.with_logical_partitioning(normal_init(cfg.initializer_range), ("embed", "exp")),
                        (cfg.hidden_size, n_exp), jnp.float32)
    bias = self.param(ROUTER_BIAS, nn.with_logical_partitioning(nn.initializers.zeros, ("exp",)),
                      (n_exp,), jnp.float32)
    logits = jnp.dot(tokens.astype(jnp.float32), kernel)
    if cfg.moe_impl == "pallas":
      from pallas_kernels import moe as pallas_moe  # loaded only when chosen
      r = pallas_moe.route(logits, bias, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                           topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                           routed_scaling_factor=cfg.routed_scaling_factor, sort=False)
      return r.weights, r.experts, r.scores
    return route(logits, bias, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                 topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                 routed_scaling_factor=cfg.routed_scaling_factor)


class Experts(nn.Module):
  """Stacked SwiGLU experts: gate_proj, up_proj [E, d, f]; down_proj [E, f, d].

  tokens [b, s, d], experts and weights [b, s, k] → (y [b, s, d] float32, overflow int32).
  Under a mesh whose `expert` axis has > 1 device (and `expert_parallel`), the tokens
  travel to their experts' devices (`k25jax.model.expert_parallel`; overflow counts the
  token-expert pairs its bounded buffers dropped); otherwise `moe_impl` runs here (overflow 0).
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, experts: jax.Array, weights: jax.Array):
    from k25jax.model import expert_parallel  # imports this module
    cfg = self.cfg
    shape_in = (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    shape_out = (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    init = normal_init(cfg.initializer_range)
    dtype, pdtype = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)

    def weight(name, shape, axes):
      return self.param(name, nn.with_logical_partitioning(init, axes), shape, pdtype).astype(dtype)

    gate = weight("gate_proj", shape_in, ("exp", "embed", "moe_mlp"))
    up = weight("up_proj", shape_in, ("exp", "embed", "moe_mlp"))
    down = weight("down_proj", shape_out, ("exp", "moe_mlp", "embed"))
    tokens = tokens.astype(dtype)
    if expert_parallel.active(cfg) and not self.is_initializing():
      return expert_parallel.sharded_experts(cfg, tokens, experts, weights, gate, up, down)
    shape = tokens.shape
    tokens, experts, weights = (a.reshape(-1, a.shape[-1]) for a in (tokens, experts, weights))
    if cfg.moe_impl == "dense":
      y = experts_dense(tokens, experts, weights, gate, up, down)
    elif cfg.moe_impl == "ragged":
      y = experts_ragged(tokens, experts, weights, gate, up, down, cfg.moe_block_size)
    elif cfg.moe_impl == "ragged_dot":
      y = experts_ragged_dot(tokens, experts, weights, gate, up, down)
    elif cfg.moe_impl == "pallas":
      from pallas_kernels import moe as pallas_moe  # loaded only when chosen
      y = pallas_moe.routed_experts(tokens, experts, weights, gate, up, down)
    else:
      raise NotImplementedError(f"moe_impl={cfg.moe_impl!r}")
    return y.reshape(shape), jnp.zeros((), jnp.int32)


class MoE(nn.Module):
  """Router + routed experts + shared expert. Returns (y, {"load", "balance_loss", "overflow"})."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, token_mask: jax.Array | None = None):
    cfg = self.cfg
    batch, seq, d = x.shape
    tokens = x.reshape(batch * seq, d)
    weights, experts, scores = Router(cfg, name="gate")(tokens)
    routed, overflow = Experts(cfg, name="experts")(x, experts.reshape(batch, seq, -1),
                                                    weights.reshape(batch, seq, -1))
    y = routed.astype(x.dtype)
    if cfg.n_shared_experts:
      y = y + MLP(d, cfg.moe_intermediate_size * cfg.n_shared_experts, std=cfg.initializer_range,
                  dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype), name="shared_experts")(x)
    mask = jnp.ones((batch, seq), bool) if token_mask is None else token_mask
    aux = {
        "load": expert_load(experts, cfg.n_routed_experts, mask),
        "balance_loss": sequence_balance_loss(scores.reshape(batch, seq, -1),
                                              experts.reshape(batch, seq, -1), mask),
        "overflow": overflow,
    }
    return y, aux
