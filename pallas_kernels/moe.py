"""MoE kernels: noaux_tc routing with the expert sort, grouped matmuls, and the expert layer.

    routing   = route(logits, bias, top_k=..., ...)        # moe_routing: one kernel
    y_sorted  = gmm(x_sorted, w, routing.group_sizes)       # moe_gmm: differentiable

The dropless SwiGLU expert layer over expert-sorted rows (`routed_experts`):

    X_s   = x[order // k]                                  (row i of X_s: assignment order[i])
    H     = silu(gmm(X_s, W_gate)) ⊙ gmm(X_s, W_up)
    Y_s   = gmm(H, W_down)
    y_t   = Σ_j w_tj · Y_s[position(t·k + j)]

pays for the routed rows only. Expert parallelism: a shard holding experts
[o, o + E_local) passes group_offset=o and its rhs slice; rows of other shards come
out zero (the dispatch/combine collectives are the caller's).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe_gmm import gmm, reference_gmm, reference_tgmm, tgmm
from pallas_kernels.moe_routing import Routing, route, sort_by_expert
from pallas_kernels.moe_routing import reference as reference_route

__all__ = ["Routing", "route", "sort_by_expert", "reference_route", "gmm", "tgmm", "reference_gmm",
           "reference_tgmm", "routed_experts"]


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                   down: jax.Array, *, tiling: tuple[int, int, int] | None = None,
                   interpret: bool | None = None) -> jax.Array:
  """Σ_j w_tj · FFN_{e_tj}(x_t) with the Pallas sort and gmm; float32 [T, d].

  x: [T, d]; experts, weights: [T, k]; gate, up: [E, d, f]; down: [E, f, d]. The same
  contract as `k25jax.ops.moe.experts_dense` (its XLA reference).
  """
  n_tokens, top_k = experts.shape
  group_sizes, order, position = sort_by_expert(experts, gate.shape[0], interpret=interpret)
  rows = x[order // top_k]
  kw = dict(tiling=tiling, interpret=interpret)
  h = jax.nn.silu(gmm(rows, gate, group_sizes, **kw)) * gmm(rows, up, group_sizes, **kw)
  y = gmm(h, down, group_sizes, **kw)[position].reshape(n_tokens, top_k, -1)
  return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), weights)
