"""Flash attention over packed segments, causal or not, with q/k head dim ≠ v head dim.

For one (batch row, head):

    s_ij = scale · q_i·k_j          visible(i, j) = seg_i = seg_j  ∧  (j ≤ i if causal)
    o_i  = Σ_j p_ij v_j,   p_ij = exp(s_ij − M_i) / ℓ_i   over visible j,
    M_i  = max_j s_ij,     ℓ_i = Σ_j exp(s_ij − M_i),     lse_i = M_i + log ℓ_i.

Two models use it, each through its own module: MLA training, causal with d_qk ≠ d_v
(192/128 for K2.5) and the per-head max logit (`pallas_kernels.mla_attention`), and
MoonViT-3D over one packed sequence of patches, segments only, d = 72 for K2.5
(`pallas_kernels.vision_attention`).

Forward (a program per query block of `block_q` rows, visiting key blocks of `block_k`),
online softmax in float32: per key block,

    M' = max(M, rowmax s),  ℓ' = e^{M−M'} ℓ + Σ_j e^{s_ij−M'},  acc' = e^{M−M'} acc + e^{s−M'} V,

and o = acc / ℓ (ℓ ≥ 1: every row sees itself). The final M_i is the largest visible logit
of row i, returned beside the output (MLA's QK-Clip reads its max over rows).

Backward (FlashAttention-2), with D_i = Σ_c dO_ic O_ic and p_ij = exp(s_ij − lse_i):

    dV_j = Σ_i p_ij dO_i,   dP_ij = dO_i·V_j,   dS_ij = p_ij (dP_ij − D_i),
    dK_j = scale Σ_i dS_ij q_i,   dQ_i = scale Σ_j dS_ij k_j.

One kernel per key block accumulates dK, dV over query blocks, another per query block
accumulates dQ over key blocks; the row max has no gradient.

Which tiles a program visits: it owns one block (of queries for the forward and dQ, of
keys for dK/dV) and visits a span [lo, hi] of blocks of the other side; the tiles outside
are skipped (neither computed nor copied).

* causal: the key blocks up to the diagonal, and for dK/dV the query blocks from it down;
* segments only: the blocks within reach of the owned block's segments. With first(σ),
  last(σ) the first and last position of segment σ, row r sees only positions in
  [first(seg_r), last(seg_r)], so the owned rows see only [min_r first(seg_r),
  max_r last(seg_r)], and the span is the blocks meeting it. XLA computes the spans before
  the kernels (positions min/max-scattered by id, O(s)) and hands them over as scalar
  prefetch on TPU (the index maps read them too) or as one-element blocks on GPU. When every
  segment is contiguous and the ids lie in [0, s] (NaViT packing: an item's patches are
  consecutive, ids 1..items, padding 0) the span is exactly the blocks sharing a segment
  with the owned one; otherwise (a segment in pieces, ids clipped together) it is a
  superset, and the mask does the rest.

The kernels see [batch, heads, seq, dim], the sequence padded to both blocks with rows of
segment −1, a segment of their own (real ids must be ≥ 0), so no real row sees one, in one
of two formulations:

* tiled (TPU, and the interpreter by default): the visited blocks are a grid axis too,
  grid (b, h, owned block, visited block), the last one sequential ("arbitrary"). The
  state (M, ℓ, acc; or dK, dV; or dQ) lives in f32 VMEM scratch: zeroed at the first
  visited block, updated by each tile in the span (`pl.when`; outside it the index map
  repeats the nearest block of the span, so no copy is issued), written out at the last.
  A program holds, at any length, double-buffered tiles and its state:
  forward q, o [bq, ·], k, v [bk, ·], M, ℓ [bq, 1] and acc [bq, d_v]; dK/dV k, v, dK, dV
  [bk, ·], q, dO, lse, D [bq, ·] and dK, dV [bk, d_qk + d_v]; dQ q, dO, lse, D, dQ
  [bq, ·], k, v [bk, ·] and dQ [bq, d_qk]. At MLA's K2.5 dims (d_qk 192, d_v 128) in bf16
  with the TPU blocks (256, 512), compiled for a v5p chip (libtpu, no TPU): 1.8 / 3.7 / 2.6
  MiB of scoped VMEM for forward / dK,dV / dQ at 8K–32K tokens, 2.8 / 4.2 / 3.0 MiB at
  262,144 (Mosaic spends about a byte a token on each [seq, 1] column: segments, lse,
  D), against the default 16 MiB limit. Whole K/V rows per program needed 24.75 MiB at 32K.
* rows (GPU; Triton has no scratch and runs grid programs concurrently): grid (b, h,
  owned block), the visited side a whole row that the kernel walks over the span with
  `fori_loop`. On Triton a block is a pointer, and each step loads one [block, d] tile, so
  a program's registers and shared memory are O(block) there too. The head dims are
  padded to powers of two (zeros change no dot product).

The XLA references are `k25jax.ops.attention.causal_attention` and
`k25jax.ops.attention.block_diagonal_attention`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common

# (block_q, block_k) per target; the smallest block each target accepts.
DEFAULT_BLOCKS = {"tpu": (256, 512), "gpu": (64, 64), "interpret": (128, 128)}
MIN_BLOCK = {"tpu": 128, "gpu": 16, "interpret": 8}
PAD_SEGMENT = -1       # the segment of the rows padding the sequence to the blocks


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  block_q: int
  block_k: int
  where: str          # "tpu" | "gpu" | "interpret"
  tiled: bool         # the TPU formulation (grid over both sides); else the GPU one (row loops)
  causal: bool        # j ≤ i too; else the visited spans come from the segments


# ------------------------------------------------------------------------------ in-kernel math
def _scores(q, k, scale):
  """scale · q kᵀ in float32: [bq, d] × [bk, d] → [bq, bk]."""
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return s * scale


def _visible(q_start, q_seg, k_start, k_seg, st: _Static):
  """Same-segment (∧ causal) mask of a [bq, bk] tile; q_seg [bq, 1], k_seg [1, bk]."""
  same = q_seg == k_seg
  if not st.causal:
    return same
  shape = (st.block_q, st.block_k)
  q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
  k_pos = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
  return (q_pos >= k_pos) & same


def _last_k(i, st: _Static):
  """The last key block at or below the diagonal of query block i."""
  return lax.div(i * st.block_q + st.block_q - 1, st.block_k)


def _first_q(j, st: _Static):
  """The first query block at or below the diagonal of key block j."""
  return lax.div(j * st.block_k, st.block_q)


def _softmax_step(q, k, v, mask, scale, m, l, acc):
  """One key block of the online softmax: (M, ℓ, acc) → (M', ℓ', acc')."""
  s = jnp.where(mask, _scores(q, k, scale), -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)        # a row with nothing visible yet
  p = jnp.exp(s - m_safe)
  alpha = jnp.exp(m - m_safe)
  l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
  acc = alpha * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return m_new, l, acc


def _write_softmax(o_ref, lse_ref, max_ref, m, l, acc):
  o_ref[...] = (acc / l).astype(o_ref.dtype)                 # ℓ ≥ 1: every row sees itself
  lse_ref[...] = m + jnp.log(l)
  max_ref[...] = m


def _probs_and_ds(q, k, v, do, lse, d, mask, scale):
  """p_ij = exp(s_ij − lse_i) over visible pairs and dS_ij = p_ij (dO_i·V_j − D_i) of a tile."""
  p = jnp.where(mask, jnp.exp(_scores(q, k, scale) - lse), 0.0)
  dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return p, p * (dp - d)


def _dkv_step(q, k, v, do, lse, d, mask, scale, dk, dv):
  """dV += pᵀ dO, dK += dSᵀ q over one tile (dK's factor `scale` is applied at the end)."""
  p, ds = _probs_and_ds(q, k, v, do, lse, d, mask, scale)
  dv = dv + lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
  dk = dk + lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
  return dk, dv


def _dq_step(q, k, v, do, lse, d, mask, scale, dq):
  """dQ += dS k over one tile (the factor `scale` is applied at the end)."""
  _, ds = _probs_and_ds(q, k, v, do, lse, d, mask, scale)
  return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------ tiled kernels (TPU)
# Each kernel gets `lo`, `hi`: the span of visited blocks of its owned block (`_spans`).
def _fwd_tiled_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, o_ref, lse_ref, max_ref,
                      m_ref, l_ref, acc_ref, *, st: _Static, lo, hi):
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when((lo <= j) & (j <= hi))
  def _step():
    mask = _visible(i * st.block_q, q_seg_ref[...], j * st.block_k, k_seg_ref[...], st)
    m, l, acc = _softmax_step(q_ref[...], k_ref[...], v_ref[...], mask, st.scale,
                              m_ref[...], l_ref[...], acc_ref[...])
    m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    _write_softmax(o_ref, lse_ref, max_ref, m_ref[...], l_ref[...], acc_ref[...])


def _dkv_tiled_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, q_seg_ref, k_seg_ref, dk_ref, dv_ref,
                      dk_acc, dv_acc, *, st: _Static, lo, hi):
  j, i = pl.program_id(2), pl.program_id(3)

  @pl.when(i == 0)
  def _init():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  @pl.when((lo <= i) & (i <= hi))
  def _step():
    mask = _visible(i * st.block_q, q_seg_ref[...], j * st.block_k, k_seg_ref[...], st)
    dk, dv = _dkv_step(q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...], d_ref[...],
                       mask, st.scale, dk_acc[...], dv_acc[...])
    dk_acc[...], dv_acc[...] = dk, dv

  @pl.when(i == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = (dk_acc[...] * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_tiled_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, q_seg_ref, k_seg_ref, dq_ref, dq_acc, *,
                     st: _Static, lo, hi):
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  @pl.when((lo <= j) & (j <= hi))
  def _step():
    mask = _visible(i * st.block_q, q_seg_ref[...], j * st.block_k, k_seg_ref[...], st)
    dq_acc[...] = _dq_step(q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...], d_ref[...],
                           mask, st.scale, dq_acc[...])

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (dq_acc[...] * st.scale).astype(dq_ref.dtype)


# ------------------------------------------------------------------------------ row kernels (GPU)
def _fwd_rows_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, o_ref, lse_ref, max_ref, *, st: _Static,
                     lo, hi):
  bq, bk = st.block_q, st.block_k
  i = pl.program_id(2)
  q, q_seg = q_ref[...], q_seg_ref[...]

  def step(j, carry):
    k_start = pl.multiple_of(j * bk, bk)
    keys = pl.ds(k_start, bk)
    mask = _visible(i * bq, q_seg, k_start, k_seg_ref[:, keys], st)
    return _softmax_step(q, k_ref[keys, :], v_ref[keys, :], mask, st.scale, *carry)

  init = (jnp.full((bq, 1), -jnp.inf, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
          jnp.zeros((bq, v_ref.shape[-1]), jnp.float32))
  _write_softmax(o_ref, lse_ref, max_ref, *lax.fori_loop(lo, hi + 1, step, init))


def _dkv_rows_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, q_seg_ref, k_seg_ref, dk_ref, dv_ref, *,
                     st: _Static, lo, hi):
  bq, bk = st.block_q, st.block_k
  j = pl.program_id(2)
  k, v, k_seg = k_ref[...], v_ref[...], k_seg_ref[...]

  def step(i, carry):
    q_start = pl.multiple_of(i * bq, bq)
    queries = pl.ds(q_start, bq)
    mask = _visible(q_start, q_seg_ref[queries, :], j * bk, k_seg, st)
    return _dkv_step(q_ref[queries, :], k, v, do_ref[queries, :], lse_ref[queries, :],
                     d_ref[queries, :], mask, st.scale, *carry)

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = lax.fori_loop(lo, hi + 1, step, init)
  dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_rows_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, q_seg_ref, k_seg_ref, dq_ref, *,
                    st: _Static, lo, hi):
  bq, bk = st.block_q, st.block_k
  i = pl.program_id(2)
  q, do, lse, d, q_seg = q_ref[...], do_ref[...], lse_ref[...], d_ref[...], q_seg_ref[...]

  def step(j, dq):
    k_start = pl.multiple_of(j * bk, bk)
    keys = pl.ds(k_start, bk)
    mask = _visible(i * bq, q_seg, k_start, k_seg_ref[:, keys], st)
    return _dq_step(q, k_ref[keys, :], v_ref[keys, :], do, lse, d, mask, st.scale, dq)

  dq = lax.fori_loop(lo, hi + 1, step, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


# ------------------------------------------------------------------------------ visited spans
def _spans(st: _Static, seq: int) -> tuple[Callable, Callable]:
  """(span of a query block's key blocks, span of a key block's query blocks).

  Each maps (batch row, owned block, *bounds) to (lo, hi). Causal: from the diagonal, no
  bounds. Segments: read from the bounds `_segment_spans` made, whole [b, blocks] arrays
  in SMEM (tiled) or the program's one-element blocks (rows).
  """
  if st.causal:
    return (lambda b, i: (0, _last_k(i, st))), (lambda b, j: (_first_q(j, st), seq // st.block_q - 1))
  if st.tiled:
    read = lambda b, own, lo, hi: (lo[b, own], hi[b, own])
  else:
    read = lambda b, own, lo, hi: (lo[0], hi[0])
  return read, read


def _segment_reach(seg: jax.Array) -> tuple[jax.Array, jax.Array]:
  """first[p], last[p] [b, s]: every row of seg[p]'s segment lies at a position in [first, last].

  Positions are min/max-scattered by id into s + 2 buckets: ids −1 … s one each, the ids
  beyond joining the end buckets. Ids sharing a bucket widen each other's reach, never cut
  it; an id alone in its bucket gets exactly its first and last position.
  """
  b, s = seg.shape
  bucket = jnp.clip(seg + 1, 0, s + 1)
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  first = jax.vmap(functools.partial(jax.ops.segment_min, num_segments=s + 2))(pos, bucket)
  last = jax.vmap(functools.partial(jax.ops.segment_max, num_segments=s + 2))(pos, bucket)
  return jnp.take_along_axis(first, bucket, 1), jnp.take_along_axis(last, bucket, 1)


def _segment_spans(seg: jax.Array, block_q: int, block_k: int) -> tuple[jax.Array, ...]:
  """(lo, hi) [b, s/block_q] of the key blocks each query block reaches, then (lo, hi)
  [b, s/block_k] of the query blocks each key block reaches (int32): for a block of `own` rows
  among blocks of `other`, [min_r first(seg_r) / other, max_r last(seg_r) / other] over its rows r."""
  first, last = _segment_reach(seg)
  b, s = seg.shape

  def spans(own, other):
    lo = jnp.min(first.reshape(b, s // own, own), axis=2) // other
    hi = jnp.max(last.reshape(b, s // own, own), axis=2) // other
    return lo.astype(jnp.int32), hi.astype(jnp.int32)

  return (*spans(block_q, block_k), *spans(block_k, block_q))


# ------------------------------------------------------------------------------ pallas_calls
def _rows(block, dim, index):
  """[b, h, seq, dim] in blocks of `block` rows; `index(b, *grid ids after b, h)` picks the block."""
  return pl.BlockSpec((None, None, block, dim), lambda b, h, *g: (b, h, index(b, *g), 0))


def _q_seg(block, index):
  return pl.BlockSpec((None, block, 1), lambda b, h, *g: (b, index(b, *g), 0))


def _k_seg(block, index):
  return pl.BlockSpec((None, 1, block), lambda b, h, *g: (b, 0, index(b, *g)))


class _Walk(NamedTuple):
  """How a pass walks [b, h, seq, ·]: a program owns one block of rows and visits the other side."""
  tail: tuple[int, ...]          # the grid after (b, h)
  own: Callable                  # (b, grid ids after (b, h), *prefetched) → the owned block
  block: int                     # rows of a visited block (the whole row in the rows formulation)
  visit: Callable                # (b, grid ids after (b, h), *prefetched) → the visited block
  span: Callable                 # (b, owned block, *bounds) → (lo, hi), the visited blocks


def _walk(st: _Static, seq: int, own: int, other: int, span: Callable) -> _Walk:
  """Tiled: grid (b, h, seq/own, seq/other), the visited block clamped to the span, so the
  steps outside it repeat the nearest needed block and issue no copy. Rows: grid
  (b, h, seq/own), the whole row visited."""
  if st.tiled:
    return _Walk((seq // own, seq // other), lambda b, i, j, *pre: i, other,
                 lambda b, i, j, *pre: jnp.clip(j, *span(b, i, *pre)), span)
  return _Walk((seq // own,), lambda b, i: i, seq, lambda b, i: 0, span)


def _call(kernels, st: _Static, b: int, h: int, walk: _Walk, scratch, bounds, *, in_specs, **kwargs):
  """pallas_call of the (tiled, rows) kernel; `scratch`: shapes of the tiled kernel's f32 state;
  `bounds`: the span arrays (none when causal), scalar prefetch (tiled) or inputs (rows)."""
  tiled_kernel, rows_kernel = kernels
  kernel = tiled_kernel if st.tiled else rows_kernel

  @functools.wraps(kernel)
  def spanned(*refs):
    lo, hi = walk.span(pl.program_id(0), pl.program_id(2), *refs[:len(bounds)])
    kernel(*refs[len(bounds):], st=st, lo=lo, hi=hi)

  semantics = ("parallel",) * 3 + ("arbitrary",) * (len(walk.tail) - 1)
  grid = (b, h, *walk.tail)
  scratch = [pltpu.VMEM(shape, jnp.float32) for shape in scratch] if st.tiled else ()
  kwargs.update(compiler_params=common.compiler_params(st.where, semantics),
                interpret=st.where == "interpret")
  if bounds and st.tiled:
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(bounds), grid=grid, in_specs=in_specs,
                                             out_specs=kwargs.pop("out_specs"), scratch_shapes=scratch)
    call = pl.pallas_call(spanned, grid_spec=grid_spec, **kwargs)
  else:
    in_specs = [pl.BlockSpec((None, 1), lambda b, h, i: (b, i)) for _ in bounds] + in_specs
    call = pl.pallas_call(spanned, grid=grid, in_specs=in_specs, scratch_shapes=scratch, **kwargs)
  return functools.partial(call, *bounds)


def _forward(q, k, v, q_seg, k_seg, bounds, st: _Static):
  b, h, seq, dqk = q.shape
  dv = v.shape[-1]
  bq = st.block_q
  w = _walk(st, seq, bq, st.block_k, _spans(st, seq)[0])
  bk = w.block
  stat = jax.ShapeDtypeStruct((b, h, seq, 1), jnp.float32)
  return _call(
      (_fwd_tiled_kernel, _fwd_rows_kernel), st, b, h, w, [(bq, 1), (bq, 1), (bq, dv)], bounds[:2],
      in_specs=[_rows(bq, dqk, w.own), _rows(bk, dqk, w.visit), _rows(bk, dv, w.visit),
                _q_seg(bq, w.own), _k_seg(bk, w.visit)],
      out_specs=[_rows(bq, dv, w.own), _rows(bq, 1, w.own), _rows(bq, 1, w.own)],
      out_shape=[jax.ShapeDtypeStruct((b, h, seq, dv), q.dtype), stat, stat],
  )(q, k, v, q_seg, k_seg)


def _backward(q, k, v, q_seg, k_seg, bounds, o, lse, do, st: _Static):
  b, h, seq, dqk = q.shape
  dv = v.shape[-1]
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
  keys_span, queries_span = _spans(st, seq)

  bk = st.block_k                                            # dK, dV: a program per key block
  w = _walk(st, seq, bk, st.block_q, queries_span)
  bq = w.block
  dk, dv_ = _call(
      (_dkv_tiled_kernel, _dkv_rows_kernel), st, b, h, w, [(bk, dqk), (bk, dv)], bounds[2:],
      in_specs=[_rows(bq, dqk, w.visit), _rows(bk, dqk, w.own), _rows(bk, dv, w.own),
                _rows(bq, dv, w.visit), _rows(bq, 1, w.visit), _rows(bq, 1, w.visit),
                _q_seg(bq, w.visit), _k_seg(bk, w.own)],
      out_specs=[_rows(bk, dqk, w.own), _rows(bk, dv, w.own)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
  )(q, k, v, do, lse, delta, q_seg, k_seg)

  bq = st.block_q                                            # dQ: a program per query block
  w = _walk(st, seq, bq, st.block_k, keys_span)
  bk = w.block
  dq = _call(
      (_dq_tiled_kernel, _dq_rows_kernel), st, b, h, w, [(bq, dqk)], bounds[:2],
      in_specs=[_rows(bq, dqk, w.own), _rows(bk, dqk, w.visit), _rows(bk, dv, w.visit),
                _rows(bq, dv, w.own), _rows(bq, 1, w.own), _rows(bq, 1, w.own),
                _q_seg(bq, w.own), _k_seg(bk, w.visit)],
      out_specs=_rows(bq, dqk, w.own),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
  )(q, k, v, do, lse, delta, q_seg, k_seg)
  return dq, dk, dv_


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, q_seg, k_seg, bounds, st: _Static):
  """[b, h, s, d] in → (out [b, h, s, dv], row max [b, h, s, 1]); s a multiple of both blocks;
  bounds: () when causal, else the (lo, hi) spans of the query blocks, then of the key blocks."""
  o, _, row_max = _forward(q, k, v, q_seg, k_seg, bounds, st)
  return o, row_max


def _flash_fwd(q, k, v, q_seg, k_seg, bounds, st):
  o, lse, row_max = _forward(q, k, v, q_seg, k_seg, bounds, st)
  return (o, row_max), (q, k, v, q_seg, k_seg, bounds, o, lse)


def _flash_bwd(st, res, cotangents):
  q, k, v, q_seg, k_seg, bounds, o, lse = res
  do, _ = cotangents                                         # the row max carries no gradient
  dq, dk, dv = _backward(q, k, v, q_seg, k_seg, bounds, o, lse, do.astype(o.dtype), st)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------ public API
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, segment_ids: jax.Array,
                    *, causal: bool, block_q: int | None = None, block_k: int | None = None,
                    interpret: bool | None = None, formulation: str | None = None
                    ) -> tuple[jax.Array, jax.Array]:
  """softmax_j(scale·q_i·k_j over visible j)·v, differentiable in q, k, v.

  q, k: [b, s, h, d_qk]; v: [b, s, h, d_v]; segment_ids: [b, s] int ≥ 0. Returns
  (out [b, s, h, d_v], row_max [b, h, s] float32: the largest visible logit of each row,
  without gradient). Blocks default per target (`DEFAULT_BLOCKS`), shrunk for short
  sequences; `interpret` None = compile on TPU/GPU, interpret elsewhere; `formulation`
  "tpu" tiles both sides over the grid with VMEM scratch (the default off a GPU), "gpu"
  walks whole rows and pads the head dims to powers of two as Triton needs (the default on
  a GPU; for tests in the interpreter).
  """
  where = common.target(interpret)
  formulation = formulation or ("gpu" if where == "gpu" else "tpu")
  if formulation not in ("tpu", "gpu") or (where, formulation) == ("gpu", "tpu"):
    raise ValueError(f"formulation={formulation!r} on {where!r}: 'gpu', or 'tpu' off a GPU "
                     "(Triton has no scratch memory for the tiled grid)")
  batch, seq, heads, dqk = q.shape
  dv = v.shape[-1]
  default_q, default_k = DEFAULT_BLOCKS[where]
  cap = common.next_pow2(seq, MIN_BLOCK[where])
  bq, bk = min(block_q or default_q, cap), min(block_k or default_k, cap)
  padded = common.cdiv(seq, math.lcm(bq, bk)) * math.lcm(bq, bk)
  st = _Static(float(scale), bq, bk, where, formulation == "tpu", causal)

  seg = common.pad_to(segment_ids.astype(jnp.int32), 1, padded, PAD_SEGMENT)
  bounds = () if causal else _segment_spans(seg, bq, bk)

  def heads_first(x, dim):
    x = common.pad_to(jnp.swapaxes(x, 1, 2), 2, padded)
    return common.pad_to(x, 3, common.next_pow2(dim, 16)) if formulation == "gpu" else x

  out, row_max = _flash(heads_first(q, dqk), heads_first(k, dqk), heads_first(v, dv),
                        seg[:, :, None], seg[:, None, :], bounds, st)
  return jnp.swapaxes(out[:, :, :seq, :dv], 1, 2), lax.stop_gradient(row_max[:, :, :seq, 0])
