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


def experts_ragged(x, experts, weights, gate, up, down, block: int = 0):
  """Dropless expert compute over expert-sorted tiles (pays only for routed tokens).

  Each expert's assignments are padded to a multiple of `block` rows; tile n
  (rows n·block … n·block+block−1) belongs to one expert, so the layer is one
  batched matmul [tiles, block, d] × [tiles, d, f]. Rows: A + min(E, A)·(block−1).
  """
  n_tokens, top_k = experts.shape
  n_experts, d = gate.shape[0], x.shape[-1]
  n_assign = n_tokens * top_k
  block = block or auto_block_size(n_assign, n_experts)
  order, group_sizes = sort_by_expert(experts, n_experts)
  sorted_expert = experts.reshape(-1)[order]
  padded_sizes = (group_sizes + block - 1) // block * block
  padded_end = jnp.cumsum(padded_sizes)
  padded_start = padded_end - padded_sizes
  group_start = jnp.cumsum(group_sizes) - group_sizes
  dest = padded_start[sorted_expert] + jnp.arange(n_assign) - group_start[sorted_expert]

  n_rows = -(-(n_assign + min(n_experts, n_assign) * (block - 1)) // block) * block
  n_tiles = n_rows // block
  tile_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(n_tiles) * block, side="right"),
                            n_experts - 1)
  row_assignment = jnp.full((n_rows,), n_assign, jnp.int32).at[dest].set(order.astype(jnp.int32))
  x_padded = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)], axis=0)
  rows = x_padded[jnp.minimum(row_assignment // top_k, n_tokens)].reshape(n_tiles, block, d)
  y_rows = _swiglu(rows, gate[tile_expert], up[tile_expert], down[tile_expert],
                   "nbd,ndf->nbf", "nbf,nfd->nbd")
  assignment_row = jnp.zeros((n_assign,), jnp.int32).at[order].set(dest.astype(jnp.int32))
  y = y_rows.reshape(n_rows, d)[assignment_row].reshape(n_tokens, top_k, d)
  return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), weights)


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
  """Stacked SwiGLU experts: gate_proj, up_proj [E, d, f]; down_proj [E, f, d]."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
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
    if cfg.moe_impl == "dense":
      return experts_dense(tokens, experts, weights, gate, up, down)
    if cfg.moe_impl == "ragged":
      return experts_ragged(tokens, experts, weights, gate, up, down, cfg.moe_block_size)
    if cfg.moe_impl == "ragged_dot":
      return experts_ragged_dot(tokens, experts, weights, gate, up, down)
    if cfg.moe_impl == "pallas":
      from pallas_kernels import moe as pallas_moe  # loaded only when chosen
      return pallas_moe.routed_experts(tokens, experts, weights, gate, up, down)
    raise NotImplementedError(f"moe_impl={cfg.moe_impl!r}")


class MoE(nn.Module):
  """Router + routed experts + shared expert. Returns (y, {"load", "balance_loss"})."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, token_mask: jax.Array | None = None):
    cfg = self.cfg
    batch, seq, d = x.shape
    tokens = x.reshape(batch * seq, d)
    weights, experts, scores = Router(cfg, name="gate")(tokens)
    routed = Experts(cfg, name="experts")(tokens, experts, weights)
    y = routed.astype(x.dtype).reshape(batch, seq, d)
    if cfg.n_shared_experts:
      y = y + MLP(d, cfg.moe_intermediate_size * cfg.n_shared_experts, std=cfg.initializer_range,
                  dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype), name="shared_experts")(x)
    mask = jnp.ones((batch, seq), bool) if token_mask is None else token_mask
    aux = {
        "load": expert_load(experts, cfg.n_routed_experts, mask),
        "balance_loss": sequence_balance_loss(scores.reshape(batch, seq, -1),
                                              experts.reshape(batch, seq, -1), mask),
    }
    return y, aux
