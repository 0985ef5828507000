"""Flash attention for MLA training: q/k head dim ≠ v head dim, causal, packed segments.

For one (batch row, head), with d_qk ≠ d_v (192/128 for K2.5, 48/32 for the tiny model):

    s_ij = scale · q_i·k_j                  visible(i, j) = j ≤ i  ∧  seg_i = seg_j
    o_i  = Σ_j p_ij v_j,   p_ij = exp(s_ij − M_i) / ℓ_i   over visible j,
    M_i  = max_j s_ij,     ℓ_i = Σ_j exp(s_ij − M_i),     lse_i = M_i + log ℓ_i.

Forward (one program per query block of `block_q` rows; keys in blocks of `block_k`,
only up to the diagonal), online softmax in float32: per key block,

    M' = max(M, rowmax s),  ℓ' = e^{M−M'} ℓ + Σ_j e^{s_ij−M'},  acc' = e^{M−M'} acc + e^{s−M'} V,

and o = acc / ℓ. The final M_i is the largest visible logit of row i, so the per-head
max logit QK-Clip needs, max over rows with seg_i > 0, comes out of the same pass.

Backward (FlashAttention-2), with D_i = Σ_c dO_ic O_ic and p_ij = exp(s_ij − lse_i):

    dV_j = Σ_i p_ij dO_i,   dP_ij = dO_i·V_j,   dS_ij = p_ij (dP_ij − D_i),
    dK_j = scale Σ_i dS_ij q_i,   dQ_i = scale Σ_j dS_ij k_j.

One kernel per key block computes dK, dV (query blocks from the diagonal down), another
per query block computes dQ; the max-logit output has no gradient (as in the XLA path).

The kernels see [batch, heads, seq, dim] and a whole row's keys/values (or queries) per
program, which both Mosaic and Triton lower; the sequence is padded to the block, and
for Triton the head dims to powers of two (zeros change no dot product). The XLA
reference is `k25jax.ops.attention.causal_attention`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from k25jax.ops import attention as xla_attention
from pallas_kernels import common

# (block_q, block_k) per target; the smallest block each target accepts.
DEFAULT_BLOCKS = {"tpu": (256, 512), "gpu": (64, 64), "interpret": (128, 128)}
MIN_BLOCK = {"tpu": 128, "gpu": 16, "interpret": 8}


def reference(q, k, v, scale, segment_ids=None, chunk: int = 128):
  """The XLA path: `k25jax.ops.attention.causal_attention` → (out [b,s,h,dv], max_logits [h])."""
  return xla_attention.causal_attention(q, k, v, scale, segment_ids, chunk)


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  block_q: int
  block_k: int
  where: str          # "tpu" | "gpu" | "interpret"


# ------------------------------------------------------------------------------ in-kernel math
def _scores(q, k, scale):
  """scale · q kᵀ in float32: [bq, d] × [bk, d] → [bq, bk]."""
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return s * scale


def _visible(q_start, q_seg, k_start, k_seg, shape):
  """Causal ∧ same-segment mask of a [bq, bk] tile; q_seg [bq, 1], k_seg [1, bk]."""
  q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
  k_pos = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
  return (q_pos >= k_pos) & (q_seg == k_seg)


def _fwd_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, o_ref, lse_ref, max_ref, *, st: _Static):
  bq, bk = st.block_q, st.block_k
  q_start = pl.program_id(2) * bq
  q, q_seg = q_ref[...], q_seg_ref[...]

  def step(j, carry):
    m, l, acc = carry
    k_start = pl.multiple_of(j * bk, bk)
    v = v_ref[pl.ds(k_start, bk), :]
    s = _scores(q, k_ref[pl.ds(k_start, bk), :], st.scale)
    s = jnp.where(_visible(q_start, q_seg, k_start, k_seg_ref[:, pl.ds(k_start, bk)], s.shape), s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)      # a row with nothing visible yet
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l, acc

  init = (jnp.full((bq, 1), -jnp.inf, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
          jnp.zeros((bq, v_ref.shape[-1]), jnp.float32))
  n_blocks = lax.div(q_start + bq + bk - 1, bk)             # key blocks up to the diagonal
  m, l, acc = lax.fori_loop(0, n_blocks, step, init)
  o_ref[...] = (acc / l).astype(o_ref.dtype)                 # ℓ ≥ 1: the diagonal is visible
  lse_ref[...] = m + jnp.log(l)
  max_ref[...] = m


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, q_seg_ref, k_seg_ref, dk_ref, dv_ref, *,
                st: _Static):
  bq, bk = st.block_q, st.block_k
  k_start = pl.program_id(2) * bk
  k, v, k_seg = k_ref[...], v_ref[...], k_seg_ref[...]

  def step(i, carry):
    dk, dv = carry
    q_start = pl.multiple_of(i * bq, bq)
    q = q_ref[pl.ds(q_start, bq), :]
    do = do_ref[pl.ds(q_start, bq), :]
    s = _scores(q, k, st.scale)
    mask = _visible(q_start, q_seg_ref[pl.ds(q_start, bq), :], k_start, k_seg, s.shape)
    p = jnp.where(mask, jnp.exp(s - lse_ref[pl.ds(q_start, bq), :]), 0.0)
    dv = dv + lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = p * (dp - d_ref[pl.ds(q_start, bq), :])
    dk = dk + lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return dk, dv

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  first = lax.div(k_start, bq)                               # query blocks from the diagonal down
  dk, dv = lax.fori_loop(first, q_ref.shape[0] // bq, step, init)
  dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, q_seg_ref, k_seg_ref, dq_ref, *, st: _Static):
  bq, bk = st.block_q, st.block_k
  q_start = pl.program_id(2) * bq
  q, do, lse, d, q_seg = q_ref[...], do_ref[...], lse_ref[...], d_ref[...], q_seg_ref[...]

  def step(j, dq):
    k_start = pl.multiple_of(j * bk, bk)
    k = k_ref[pl.ds(k_start, bk), :]
    s = _scores(q, k, st.scale)
    mask = _visible(q_start, q_seg, k_start, k_seg_ref[:, pl.ds(k_start, bk)], s.shape)
    p = jnp.where(mask, jnp.exp(s - lse), 0.0)
    dp = lax.dot_general(do, v_ref[pl.ds(k_start, bk), :], (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)
    ds = p * (dp - d)
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  n_blocks = lax.div(q_start + bq + bk - 1, bk)
  dq = lax.fori_loop(0, n_blocks, step, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


# ------------------------------------------------------------------------------ pallas_calls
def _specs(st: _Static, seq: int):
  """BlockSpecs over [b, h, seq, d] arrays: one block of rows, or the whole row."""
  def rows(block, dim):
    return pl.BlockSpec((None, None, block, dim), lambda b, h, i: (b, h, i, 0))

  def whole(dim):
    return pl.BlockSpec((None, None, seq, dim), lambda b, h, i: (b, h, 0, 0))

  q_seg_rows = lambda block: pl.BlockSpec((None, block, 1), lambda b, h, i: (b, i, 0))
  k_seg_rows = lambda block: pl.BlockSpec((None, 1, block), lambda b, h, i: (b, 0, i))
  return rows, whole, q_seg_rows, k_seg_rows


def _forward(q, k, v, q_seg, k_seg, st: _Static):
  b, h, seq, dqk = q.shape
  dv = v.shape[-1]
  rows, whole, q_seg_rows, k_seg_rows = _specs(st, seq)
  stat = jax.ShapeDtypeStruct((b, h, seq, 1), jnp.float32)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, st=st),
      grid=(b, h, seq // st.block_q),
      in_specs=[rows(st.block_q, dqk), whole(dqk), whole(dv), q_seg_rows(st.block_q), k_seg_rows(seq)],
      out_specs=[rows(st.block_q, dv), rows(st.block_q, 1), rows(st.block_q, 1)],
      out_shape=[jax.ShapeDtypeStruct((b, h, seq, dv), q.dtype), stat, stat],
      compiler_params=common.compiler_params(st.where, ("parallel",) * 3),
      interpret=st.where == "interpret",
  )(q, k, v, q_seg, k_seg)


def _backward(q, k, v, q_seg, k_seg, o, lse, do, st: _Static):
  b, h, seq, dqk = q.shape
  dv = v.shape[-1]
  rows, whole, q_seg_rows, k_seg_rows = _specs(st, seq)
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
  params = common.compiler_params(st.where, ("parallel",) * 3)
  dk, dv_ = pl.pallas_call(
      functools.partial(_dkv_kernel, st=st),
      grid=(b, h, seq // st.block_k),
      in_specs=[whole(dqk), rows(st.block_k, dqk), rows(st.block_k, dv), whole(dv), whole(1), whole(1),
                q_seg_rows(seq), k_seg_rows(st.block_k)],
      out_specs=[rows(st.block_k, dqk), rows(st.block_k, dv)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params, interpret=st.where == "interpret",
  )(q, k, v, do, lse, delta, q_seg, k_seg)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, st=st),
      grid=(b, h, seq // st.block_q),
      in_specs=[rows(st.block_q, dqk), whole(dqk), whole(dv), rows(st.block_q, dv), rows(st.block_q, 1),
                rows(st.block_q, 1), q_seg_rows(st.block_q), k_seg_rows(seq)],
      out_specs=rows(st.block_q, dqk),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params, interpret=st.where == "interpret",
  )(q, k, v, do, lse, delta, q_seg, k_seg)
  return dq, dk, dv_


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, k_seg, st: _Static):
  """[b, h, s, d] in → (out [b, h, s, dv], row max [b, h, s, 1]); s a multiple of both blocks."""
  o, _, row_max = _forward(q, k, v, q_seg, k_seg, st)
  return o, row_max


def _flash_fwd(q, k, v, q_seg, k_seg, st):
  o, lse, row_max = _forward(q, k, v, q_seg, k_seg, st)
  return (o, row_max), (q, k, v, q_seg, k_seg, o, lse)


def _flash_bwd(st, res, cotangents):
  q, k, v, q_seg, k_seg, o, lse = res
  do, _ = cotangents                                         # the max logits carry no gradient
  dq, dk, dv = _backward(q, k, v, q_seg, k_seg, o, lse, do.astype(o.dtype), st)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------ public API
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                    segment_ids: jax.Array | None = None, *, block_q: int | None = None,
                    block_k: int | None = None, interpret: bool | None = None,
                    formulation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """Causal MLA attention, the same contract as `causal_attention` (differentiable in q, k, v).

  q, k: [b, s, h, d_qk]; v: [b, s, h, d_v]; segment_ids: [b, s] int, 0 = padding (padding
  queries are left out of the max). Returns (out [b, s, h, d_v], max_logits [h] float32).
  Blocks default per target (`DEFAULT_BLOCKS`), shrunk for short sequences; `interpret`
  None = compile on TPU/GPU, interpret elsewhere; `formulation` "gpu" pads the head dims
  to powers of two as Triton needs (the default on a GPU; for tests in the interpreter).
  """
  where = common.target(interpret)
  formulation = formulation or ("gpu" if where == "gpu" else "tpu")
  batch, seq, heads, dqk = q.shape
  dv = v.shape[-1]
  default_q, default_k = DEFAULT_BLOCKS[where]
  cap = common.next_pow2(seq, MIN_BLOCK[where])
  bq, bk = min(block_q or default_q, cap), min(block_k or default_k, cap)
  padded = common.cdiv(seq, max(bq, bk)) * max(bq, bk)
  st = _Static(float(scale), bq, bk, where)

  seg = jnp.ones((batch, seq), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  seg = common.pad_to(seg, 1, padded)                        # padded rows: segment 0, never a real key

  def heads_first(x, dim):
    x = common.pad_to(jnp.swapaxes(x, 1, 2), 2, padded)
    return common.pad_to(x, 3, common.next_pow2(dim, 16)) if formulation == "gpu" else x

  out, row_max = _flash(heads_first(q, dqk), heads_first(k, dqk), heads_first(v, dv),
                        seg[:, :, None], seg[:, None, :], st)
  out = jnp.swapaxes(out[:, :, :seq, :dv], 1, 2)
  row_max = jnp.where(seg[:, None, :seq] > 0, lax.stop_gradient(row_max[:, :, :seq, 0]), -jnp.inf)
  return out, jnp.max(row_max, axis=(0, 2))
