"""Fused noaux_tc routing and the expert sort, one Pallas kernel over blocks of tokens.

Per token t with router logits z_t [E] (DeepSeek-V3 / K2, as `k25jax.ops.moe.route`):

    s      = sigmoid(z)                          (float32; the `scores` output)
    c      = s + b                               (b = e_score_correction_bias, no gradient)
    groups : keep the `topk_group` groups with the largest (top-1 + top-2) of c
    K      = top-k of c among the kept groups    (k rounds of argmax, lowest index on ties,
                                                  which is the order of `lax.top_k`)
    w_e    = rsf · s_e / (Σ_{e'∈K} s_e' + 1e-20)  (the UNBIASED s; rsf = routed_scaling_factor)

The sort (counting sort, stable): assignment a = t·k + j goes to sorted position

    pos(a) = start[e_a] + Σ_{blocks β before a's} hist_β[e_a] + rank_a,

with start the exclusive prefix sum of the group sizes, hist_β the expert histogram of
token block β, and rank_a the number of earlier assignments of a's block routed to the
same expert. The kernel emits hist and rank; rank is one 0/1 matmul per block,
rank = (L · H)[t, e_a] with L strictly lower triangular [bt, bt] and H the block's
multi-hot [bt, E] (a token's k experts are distinct, so its own slots never count).
`order` (sorted position → assignment) is pos inverted.

Backward (XLA, elementwise): with u_j = s_{e_j}, U = Σ_j u_j + 1e-20 and g = ∂L/∂w,
∂L/∂u_j = rsf (g_j/U − Σ_i g_i u_i / U²) (rsf g_j without normalisation), scattered into
∂L/∂s, and ∂L/∂z = s(1 − s) ∂L/∂s. The bias gets no gradient.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from k25jax.ops import moe as xla_moe
from pallas_kernels import common

DEFAULT_BLOCK = {"tpu": 256, "gpu": 64, "interpret": 128}


class Routing(NamedTuple):
  """Routing of T tokens to k of E experts, and the expert-sorted order of the T·k assignments."""
  weights: jax.Array       # [T, k] float32, rsf-scaled
  experts: jax.Array       # [T, k] int32
  scores: jax.Array        # [T, E] float32, sigmoid(logits)
  group_sizes: jax.Array   # [E] int32, assignments per expert
  order: jax.Array         # [T·k] int32, sorted position → assignment t·k + j
  position: jax.Array      # [T·k] int32, assignment → sorted position (order's inverse)


@dataclasses.dataclass(frozen=True)
class _Static:
  top_k: int               # real k
  k_out: int               # columns written (k, or k padded to a power of two for Triton)
  n_group: int             # groups as laid out in the kernel (padded for Triton)
  per_group: int           # experts per group as laid out in the kernel
  limit_groups: bool
  topk_group: int
  norm_topk_prob: bool
  scale: float             # routed_scaling_factor
  block: int
  n_tokens: int
  where: str
  sort: bool = True        # emit ranks and histograms (else zeros)


# ------------------------------------------------------------------------------ in-kernel pieces
def _argmax_first(x, iota, size):
  """Per-row (max, lowest index attaining it), both [rows, 1].

  The index reduction runs in float32 (exact below 2^24), which every backend reduces.
  """
  best = jnp.max(x, axis=1, keepdims=True)
  first = jnp.min(jnp.where(x == best, iota.astype(jnp.float32), float(size)), axis=1, keepdims=True)
  return best, first.astype(jnp.int32)


def _group_mask(choice, iota, st: _Static):
  """Experts of the `topk_group` groups with the largest top-1 + top-2 of `choice`."""
  n_exp = choice.shape[1]
  group_of = lax.div(iota, jnp.int32(st.per_group))
  group_score = []
  for g in range(st.n_group):
    in_g = jnp.where(group_of == g, choice, -jnp.inf)
    top1, i1 = _argmax_first(in_g, iota, n_exp)
    top2 = jnp.max(jnp.where(iota == i1, -jnp.inf, in_g), axis=1, keepdims=True)
    group_score.append(top1 + top2)
  kept = [jnp.zeros_like(group_score[0], bool) for _ in range(st.n_group)]
  for _ in range(st.topk_group):
    best = functools.reduce(jnp.maximum, group_score)
    pick = jnp.full(best.shape, st.n_group, jnp.int32)
    for g in reversed(range(st.n_group)):                    # lowest group index on ties
      pick = jnp.where(group_score[g] == best, g, pick)
    for g in range(st.n_group):
      kept[g] = kept[g] | (pick == g)
      group_score[g] = jnp.where(pick == g, -jnp.inf, group_score[g])
  return functools.reduce(jnp.logical_or, [(group_of == g) & kept[g] for g in range(st.n_group)])


def _ranks(picks, iota, valid):
  """(rank of each pick among same-expert picks of earlier tokens in the block, histogram [1, E])."""
  hot = functools.reduce(jnp.logical_or, [iota == p for p in picks]) & valid
  hot = hot.astype(jnp.bfloat16)                              # 0/1: exact in bf16, counts in f32
  rows = hot.shape[0]
  lower = (lax.broadcasted_iota(jnp.int32, (rows, rows), 0)
           > lax.broadcasted_iota(jnp.int32, (rows, rows), 1)).astype(jnp.bfloat16)
  before = jnp.dot(lower, hot, preferred_element_type=jnp.float32)
  ranks = [jnp.sum(jnp.where(iota == p, before, 0.0), axis=1, keepdims=True) for p in picks]
  return ranks, jnp.sum(hot.astype(jnp.float32), axis=0, keepdims=True)


def _columns(values, k_out, dtype):
  """[rows, 1] columns → one [rows, k_out] array (columns past len(values) are 0)."""
  col = lax.broadcasted_iota(jnp.int32, (values[0].shape[0], k_out), 1)
  out = jnp.zeros(col.shape, dtype)
  for j, value in enumerate(values):
    out = jnp.where(col == j, value.astype(dtype), out)
  return out


def _valid_rows(st: _Static, rows):
  return pl.program_id(0) * st.block + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < st.n_tokens


def _route_kernel(logits_ref, bias_ref, w_ref, e_ref, s_ref, rank_ref, hist_ref, *, st: _Static):
  s = jax.nn.sigmoid(logits_ref[...].astype(jnp.float32))
  choice = s + bias_ref[...]
  n_exp = s.shape[1]
  iota = lax.broadcasted_iota(jnp.int32, s.shape, 1)
  if st.limit_groups:
    choice = jnp.where(_group_mask(choice, iota, st), choice, -jnp.inf)
  picks, weights = [], []
  for _ in range(st.top_k):
    _, idx = _argmax_first(choice, iota, n_exp)
    picks.append(idx)
    weights.append(jnp.sum(jnp.where(iota == idx, s, 0.0), axis=1, keepdims=True))
    choice = jnp.where(iota == idx, -jnp.inf, choice)
  if st.norm_topk_prob:
    total = functools.reduce(jnp.add, weights) + 1e-20
    weights = [w / total for w in weights]
  if st.sort:
    ranks, hist = _ranks(picks, iota, _valid_rows(st, s.shape[0]))
  else:
    ranks, hist = [jnp.zeros_like(p) for p in picks], jnp.zeros((1, n_exp), jnp.float32)
  w_ref[...] = _columns([w * st.scale for w in weights], st.k_out, jnp.float32)
  e_ref[...] = _columns(picks, st.k_out, jnp.int32)
  s_ref[...] = s
  rank_ref[...] = _columns(ranks, st.k_out, jnp.int32)
  hist_ref[...] = hist.astype(jnp.int32)


def _sort_kernel(e_ref, rank_ref, hist_ref, *, st: _Static, n_exp: int):
  experts = e_ref[...].astype(jnp.float32)                   # exact ids; float sums reduce everywhere
  col = lax.broadcasted_iota(jnp.int32, experts.shape, 1)
  picks = [jnp.sum(jnp.where(col == j, experts, 0.0), axis=1, keepdims=True).astype(jnp.int32)
           for j in range(st.top_k)]
  iota = lax.broadcasted_iota(jnp.int32, (experts.shape[0], n_exp), 1)
  ranks, hist = _ranks(picks, iota, _valid_rows(st, experts.shape[0]))
  rank_ref[...] = _columns(ranks, st.k_out, jnp.int32)
  hist_ref[...] = hist.astype(jnp.int32)


# ------------------------------------------------------------------------------ wrappers
def _positions(experts, ranks, hist, block):
  """pos = start[e] + (earlier blocks' count of e) + rank; and its inverse."""
  n_tokens, top_k = experts.shape
  group_sizes = jnp.sum(hist, axis=0)
  start = jnp.cumsum(group_sizes) - group_sizes
  block_prefix = jnp.cumsum(hist, axis=0) - hist                                  # [blocks, E]
  token_block = jnp.arange(n_tokens) // block
  position = start[experts] + block_prefix[token_block[:, None], experts] + ranks
  position = position.reshape(-1).astype(jnp.int32)
  order = jnp.zeros_like(position).at[position].set(jnp.arange(n_tokens * top_k, dtype=jnp.int32))
  return group_sizes.astype(jnp.int32), order, position


def _layout(n_experts, n_group, topk_group, top_k, formulation):
  """(groups, experts per group, k columns) as the kernel lays them out."""
  per = n_experts // n_group
  if formulation != "gpu":
    return n_group, per, top_k
  return common.next_pow2(n_group), common.next_pow2(per, 2), common.next_pow2(top_k)


def _to_kernel_experts(x, n_group, per, g_pad, p_pad, fill):
  """[T, E] → [T, g_pad · p_pad], each group's experts padded with `fill`."""
  x = x.reshape(x.shape[0], n_group, per)
  x = common.pad_to(common.pad_to(x, 2, p_pad, fill), 1, g_pad, fill)
  return x.reshape(x.shape[0], g_pad * p_pad)


def _call(kernel, inputs, in_widths, out_widths, out_dtypes, st: _Static, n_padded):
  nb = n_padded // st.block
  in_specs = [pl.BlockSpec((st.block, w), lambda i: (i, 0)) if w else pl.BlockSpec(x.shape, lambda i: (0, 0))
              for x, w in zip(inputs, in_widths)]
  out_specs = [pl.BlockSpec((st.block, w), lambda i: (i, 0)) for w in out_widths[:-1]]
  out_specs.append(pl.BlockSpec((None, 1, out_widths[-1]), lambda i: (i, 0, 0)))
  out_shape = [jax.ShapeDtypeStruct((n_padded, w), d) for w, d in zip(out_widths[:-1], out_dtypes[:-1])]
  out_shape.append(jax.ShapeDtypeStruct((nb, 1, out_widths[-1]), out_dtypes[-1]))
  return pl.pallas_call(kernel, grid=(nb,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        compiler_params=common.compiler_params(st.where, ("parallel",)),
                        interpret=st.where == "interpret")(*inputs)


def _route_forward(logits, bias, st: _Static, n_group, per):
  n_tokens, n_exp = logits.shape
  n_padded = common.cdiv(n_tokens, st.block) * st.block
  width = st.n_group * st.per_group
  z = _to_kernel_experts(logits.astype(jnp.float32), n_group, per, st.n_group, st.per_group, -jnp.inf)
  b = _to_kernel_experts(bias.astype(jnp.float32)[None], n_group, per, st.n_group, st.per_group, -jnp.inf)
  z = common.pad_to(z, 0, n_padded)
  w, e, s, ranks, hist = _call(functools.partial(_route_kernel, st=st), [z, b], [width, 0],
                               [st.k_out, st.k_out, width, st.k_out, width],
                               [jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.int32], st, n_padded)
  k = st.top_k
  e = e[:n_tokens, :k]
  e = (e // st.per_group) * per + e % st.per_group                     # kernel layout → expert id
  s = s[:n_tokens].reshape(n_tokens, st.n_group, st.per_group)[:, :n_group, :per].reshape(n_tokens, n_exp)
  hist = hist[:, 0].reshape(-1, st.n_group, st.per_group)[:, :n_group, :per].reshape(-1, n_exp)
  return w[:n_tokens, :k], e, s, ranks[:n_tokens, :k], hist


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _route(logits, bias, st, n_group, per):
  return _route_forward(logits, bias, st, n_group, per)


def _route_fwd(logits, bias, st, n_group, per):
  out = _route_forward(logits, bias, st, n_group, per)
  weights, experts, scores, _, _ = out
  return out, (weights, experts, scores, bias)


def _route_bwd(st, n_group, per, res, cotangents):
  weights, experts, scores, bias = res
  d_weights, _, d_scores, _, _ = cotangents
  u = jnp.take_along_axis(scores, experts, axis=-1)
  if st.norm_topk_prob:
    total = jnp.sum(u, axis=-1, keepdims=True) + 1e-20
    d_u = st.scale * (d_weights / total - jnp.sum(d_weights * u, axis=-1, keepdims=True) / total ** 2)
  else:
    d_u = st.scale * d_weights
  rows = jnp.arange(scores.shape[0])[:, None]
  d_s = d_scores.at[rows, experts].add(d_u)
  return d_s * scores * (1.0 - scores), jnp.zeros_like(bias)


_route.defvjp(_route_fwd, _route_bwd)


def route(logits: jax.Array, bias: jax.Array, *, top_k: int, n_group: int = 1, topk_group: int = 1,
          norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, sort: bool = True,
          block_tokens: int | None = None, interpret: bool | None = None,
          formulation: str | None = None) -> Routing:
  """noaux_tc routing + expert sort of logits [T, E] (float32); bias [E]. See the module docstring.

  Differentiable in the logits through `weights` and `scores`. With sort=False the
  kernel skips the ranks and group_sizes/order/position are None. `block_tokens` tokens per
  program (default per target); `formulation` "gpu" pads experts per group, groups and k
  to powers of two as Triton needs (the default on a GPU).
  """
  where = common.target(interpret)
  formulation = formulation or ("gpu" if where == "gpu" else "tpu")
  n_tokens, n_exp = logits.shape
  if n_exp % n_group or not 0 < top_k <= n_exp:
    raise ValueError(f"route: E={n_exp}, n_group={n_group}, top_k={top_k} are inconsistent")
  g_pad, p_pad, k_out = _layout(n_exp, n_group, topk_group, top_k, formulation)
  block = min(block_tokens or DEFAULT_BLOCK[where], common.next_pow2(n_tokens, 16))
  st = _Static(top_k, k_out, g_pad, p_pad, n_group > 1 and topk_group < n_group, topk_group,
               norm_topk_prob, float(routed_scaling_factor), block, n_tokens, where, sort)
  weights, experts, scores, ranks, hist = _route(logits, bias, st, n_group, n_exp // n_group)
  if not sort:
    return Routing(weights, experts, scores, None, None, None)
  return Routing(weights, experts, scores, *_positions(experts, ranks, hist, block))


def sort_by_expert(experts: jax.Array, n_experts: int, *, block_tokens: int | None = None,
                   interpret: bool | None = None, formulation: str | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The counting sort alone: experts [T, k] → (group_sizes [E], order [T·k], position [T·k])."""
  where = common.target(interpret)
  formulation = formulation or ("gpu" if where == "gpu" else "tpu")
  n_tokens, top_k = experts.shape
  k_out = common.next_pow2(top_k) if formulation == "gpu" else top_k
  e_pad = common.next_pow2(n_experts) if formulation == "gpu" else n_experts
  block = min(block_tokens or DEFAULT_BLOCK[where], common.next_pow2(n_tokens, 16))
  st = _Static(top_k, k_out, 1, e_pad, False, 1, False, 1.0, block, n_tokens, where)
  n_padded = common.cdiv(n_tokens, block) * block
  e = common.pad_to(common.pad_to(experts.astype(jnp.int32), 1, k_out, -1), 0, n_padded, -1)
  ranks, hist = _call(functools.partial(_sort_kernel, st=st, n_exp=e_pad), [e], [k_out], [k_out, e_pad],
                      [jnp.int32, jnp.int32], st, n_padded)
  return _positions(experts, ranks[:n_tokens, :top_k], hist[:, 0, :n_experts], block)


def reference(logits, bias, *, top_k, n_group=1, topk_group=1, norm_topk_prob=True,
              routed_scaling_factor=1.0) -> Routing:
  """XLA: `k25jax.ops.moe.route`, then a stable argsort of the assignments by expert."""
  weights, experts, scores = xla_moe.route(logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                                           norm_topk_prob=norm_topk_prob,
                                           routed_scaling_factor=routed_scaling_factor)
  order, group_sizes = xla_moe.sort_by_expert(experts, logits.shape[1])
  position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  return Routing(weights, experts, scores, group_sizes, order.astype(jnp.int32), position.astype(jnp.int32))
