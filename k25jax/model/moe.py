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

The router's `route` and the XLA expert paths are the pure functions of
`k25jax.ops.moe`; this module holds the Flax layer and the balancing statistics.

Expert compute paths (`ModelConfig.moe_impl`), all equal to each other:
* ``dense``      every expert on every token (the reference; pays E/k × the flops);
* ``ragged``     dropless: tokens sorted by expert into tiles of `block` rows, one
                 batched matmul over tiles (pays only for routed tokens + tile padding,
                 on every backend, CPU included); a call with few tokens (decoding) runs
                 ``dense`` instead where that moves less (`experts_ragged_or_dense`);
* ``ragged_dot`` dropless with `jax.lax.ragged_dot` (native on TPU/GPU; a masked
                 dense product on CPU);
* ``pallas``     the Pallas routing kernel, expert sort and grouped matmul
                 (`pallas_kernels.moe`; compiled on TPU/GPU, interpreted on CPU).

Expert parallelism (`k25jax.model.expert_parallel`): when the mesh's `expert` axis has
more than one device, tokens travel by all-to-all to the devices holding their experts,
which run `k25jax.ops.moe.grouped_ffn` (tiles, or `ragged_dot` with moe_impl="ragged_dot")
on what they receive.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from k25jax.model import expert_parallel, sequence_parallel
from k25jax.model.config import ModelConfig
from k25jax.model.layers import MLP, dtype_of, normal_init
from k25jax.ops.moe import experts_dense, experts_ragged_dot, experts_ragged_or_dense, route

ROUTER_BIAS = "e_score_correction_bias"


# ---------------------------------------------------------------------- load balancing
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
      kernel = functools.partial(pallas_moe.route, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                                 topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                                 routed_scaling_factor=cfg.routed_scaling_factor, sort=False)
      r = sequence_parallel.token_split(kernel, (logits,), (bias,))
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
      y = experts_ragged_or_dense(tokens, experts, weights, gate, up, down, cfg.moe_block_size)
    elif cfg.moe_impl == "ragged_dot":
      y = experts_ragged_dot(tokens, experts, weights, gate, up, down)
    elif cfg.moe_impl == "pallas":
      from pallas_kernels import moe as pallas_moe  # loaded only when chosen
      y = sequence_parallel.token_split(pallas_moe.routed_experts, (tokens, experts, weights), (gate, up, down))
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
