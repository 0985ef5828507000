"""Grouped matmul for dropless MoE: `gmm` (forward, d_lhs) and `tgmm` (d_rhs), tiled.

Rows of `lhs` [m, K] are sorted by group: group g owns rows [start_g, end_g) with
end_g = Σ_{g'≤g} group_sizes[g']. A shard holding experts [o, o + E_local) computes

    gmm:   out[r]   = lhs[r] · rhs[g(r) − o]          if o ≤ g(r) < o + E_local, else 0
           (rhs [E_local, K, N]; with transpose_rhs, rhs [E_local, N, K] and rhs[g]ᵀ)
    tgmm:  out[e]   = Σ_{r ∈ group o+e} x[r]ᵀ y[r]     ([E_local, P, Q]; 0 for an empty group)

so that for out = gmm(lhs, rhs):  d_lhs = gmm(d_out, rhs, transpose_rhs=True),
d_rhs = tgmm(lhs, d_out), which `gmm`'s custom VJP uses. Rows past the last group
and rows of other shards' groups come out zero.

Two formulations, both run by the interpreter in the tests:

* TPU (Mosaic; the interpreter's default). Rows are cut in tiles of `tm`. A *visit*
  is a (row tile, group) pair whose rows meet; visits are listed in a scalar-prefetched
  schedule and the grid is (N tiles, visits, K tiles). gmm orders visits by tile, so a
  tile that straddles groups is visited once per group, consecutively, and each visit
  writes only its group's rows into the resident output block; tiles no local group
  touches get one visit that writes zeros. tgmm orders visits by group and accumulates
  each group's [tk, tn] block in VMEM over its tiles (rows of other groups masked to
  zero); an empty group gets one visit that writes zeros. At most
  m/tm + E_local − 1 visits; the grid is that bound, spare visits do nothing.
* GPU (Triton: no scalar prefetch, no scratch). gmm: one program per output tile,
  looping over the groups that meet its rows and over K inside; tgmm: one program per
  (group, K tile, N tile), looping over its group's row tiles.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common

# (tm, tk, tn) per target: rows per tile, contraction block, output-column block.
DEFAULT_TILING = {"tpu": (128, 512, 512), "gpu": (64, 64, 128), "interpret": (128, 128, 128)}
MIN_ROWS = {"tpu": 8, "gpu": 16, "interpret": 8}
NT = (((1,), (1,)), ((), ()))      # a · bᵀ
TN = (((0,), (0,)), ((), ()))      # aᵀ · b


@dataclasses.dataclass(frozen=True)
class _Static:
  tiling: tuple[int, int, int]
  where: str
  formulation: str
  transpose_rhs: bool = False


def reference_gmm(lhs, rhs, group_sizes, group_offset=0, *, transpose_rhs=False):
  """XLA: every local expert on every row, each row keeping its own group's product."""
  num_local = rhs.shape[0]
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  local = _row_groups(lhs.shape[0], group_sizes) - group_offset                # [m]
  one_hot = jax.nn.one_hot(local, num_local, dtype=lhs.dtype)                   # 0 outside the shard
  out = jnp.einsum("mk,ekn,me->mn", lhs, rhs, one_hot, preferred_element_type=jnp.float32)
  return out.astype(lhs.dtype)


def reference_tgmm(x, y, group_sizes, group_offset, num_local):
  """XLA: out[e] = Σ_{rows r of group offset+e} x[r]ᵀ y[r]."""
  local = _row_groups(x.shape[0], group_sizes) - group_offset
  one_hot = jax.nn.one_hot(local, num_local, dtype=x.dtype)
  return jnp.einsum("mp,mq,me->epq", x, y, one_hot, preferred_element_type=jnp.float32).astype(x.dtype)


def _row_groups(m, group_sizes):
  """Group of each row, len(group_sizes) for rows past the last group."""
  return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")


# ------------------------------------------------------------------------------ schedules
def _local_bounds(group_sizes, group_offset, num_local):
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  starts = ends - group_sizes.astype(jnp.int32)
  local = group_offset + jnp.arange(num_local, dtype=jnp.int32)
  return starts[local], ends[local]


def _visits_by_tile(starts, ends, n_tiles, tm):
  """gmm schedule: (tile, local group, row start, row end, first-visit-of-tile) per visit."""
  num_local = starts.shape[0]
  lo, hi = starts[0], ends[-1]                                 # the local groups' rows
  tile_lo = jnp.arange(n_tiles, dtype=jnp.int32) * tm
  a, z = jnp.maximum(tile_lo, lo), jnp.minimum(tile_lo + tm, hi)
  meets = a < z
  g_first = jnp.searchsorted(ends, a, side="right").astype(jnp.int32)       # group holding row a
  g_last = jnp.searchsorted(ends, z - 1, side="right").astype(jnp.int32)
  count = jnp.where(meets, g_last - g_first + 1, 1)
  return _expand(count, n_tiles + num_local - 1, lambda tile, r: (
      tile, jnp.where(meets[tile], jnp.minimum(g_first[tile] + r, num_local - 1), 0), meets[tile]),
      starts, ends, by_tile=True)


def _visits_by_group(starts, ends, n_tiles, tm):
  """tgmm schedule: (tile, local group, row start, row end, first, last visit of the group)."""
  num_local = starts.shape[0]
  nonempty = ends > starts
  first_tile = jnp.minimum(starts // tm, n_tiles - 1)
  count = jnp.where(nonempty, (ends - 1) // tm - first_tile + 1, 1)
  return _expand(count, n_tiles + num_local - 1, lambda group, r: (
      jnp.where(nonempty[group], first_tile[group] + r, first_tile[group]), group, nonempty[group]),
      starts, ends, by_tile=False)


def _expand(count, n_visits, visit, starts, ends, by_tile):
  """Lists `count[u]` visits for each unit u (a tile or a group), padded to `n_visits`.

  Spare visits repeat the last real visit's blocks with an empty row range, so they
  neither copy new blocks in nor write anything.
  """
  csum = jnp.cumsum(count)
  v = jnp.arange(n_visits, dtype=jnp.int32)
  real = v < csum[-1]
  v = jnp.minimum(v, csum[-1] - 1)
  unit = jnp.searchsorted(csum, v, side="right").astype(jnp.int32)
  r = v - (csum - count)[unit]
  tile, group, live = visit(unit, r)
  live = live & real
  start = jnp.where(live, starts[group], 0)
  end = jnp.where(live, ends[group], 0)
  first = (real & (r == 0)).astype(jnp.int32)
  last = (real & (r == count[unit] - 1)).astype(jnp.int32)
  flags = (first,) if by_tile else (first, last)
  return (tile.astype(jnp.int32), group, start.astype(jnp.int32), end.astype(jnp.int32)) + flags


# ------------------------------------------------------------------------------ TPU kernels
def _gmm_tpu_kernel(tile_ref, group_ref, start_ref, end_ref, first_ref, lhs_ref, rhs_ref, out_ref, acc_ref,
                    *, transpose_rhs):
  v, kk = pl.program_id(1), pl.program_id(2)

  @pl.when(kk == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(start_ref[v] < end_ref[v])
  def _():
    dims = NT if transpose_rhs else (((1,), (0,)), ((), ()))
    acc_ref[...] += lax.dot_general(lhs_ref[...], rhs_ref[...], dims, preferred_element_type=jnp.float32)

  @pl.when(kk == pl.num_programs(2) - 1)
  def _():
    tm = out_ref.shape[0]
    rows = tile_ref[v] * tm + lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
    mine = (rows >= start_ref[v]) & (rows < end_ref[v])
    kept = jnp.where(first_ref[v] == 1, jnp.zeros(out_ref.shape, out_ref.dtype), out_ref[...])
    out_ref[...] = jnp.where(mine, acc_ref[...].astype(out_ref.dtype), kept)


def _tgmm_tpu_kernel(tile_ref, group_ref, start_ref, end_ref, first_ref, last_ref, x_ref, y_ref, out_ref,
                     acc_ref):
  v = pl.program_id(2)

  @pl.when(first_ref[v] == 1)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(start_ref[v] < end_ref[v])
  def _():
    tm = x_ref.shape[0]
    rows = tile_ref[v] * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    mine = (rows >= start_ref[v]) & (rows < end_ref[v])
    x = jnp.where(mine, x_ref[...], jnp.zeros_like(x_ref))
    y = jnp.where(mine, y_ref[...], jnp.zeros_like(y_ref))
    acc_ref[...] += lax.dot_general(x, y, TN, preferred_element_type=jnp.float32)

  @pl.when(last_ref[v] == 1)
  def _():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _gmm_tpu(lhs, rhs, starts, ends, out_dtype, st: _Static):
  tm, tk, tn = st.tiling
  m, k = lhs.shape
  n = rhs.shape[1] if st.transpose_rhs else rhs.shape[2]
  schedule = _visits_by_tile(starts, ends, m // tm, tm)
  if st.transpose_rhs:
    rhs_spec = pl.BlockSpec((None, tn, tk), lambda j, v, kk, t, g, *_: (g[v], j, kk))
  else:
    rhs_spec = pl.BlockSpec((None, tk, tn), lambda j, v, kk, t, g, *_: (g[v], kk, j))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5, grid=(n // tn, schedule[0].shape[0], k // tk),
      in_specs=[pl.BlockSpec((tm, tk), lambda j, v, kk, t, *_: (t[v], kk)), rhs_spec],
      out_specs=pl.BlockSpec((tm, tn), lambda j, v, kk, t, *_: (t[v], j)),
      scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)])
  return pl.pallas_call(
      functools.partial(_gmm_tpu_kernel, transpose_rhs=st.transpose_rhs), grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      compiler_params=common.compiler_params(st.where, ("parallel", "arbitrary", "arbitrary")),
      interpret=st.where == "interpret")(*schedule, lhs, rhs)


def _tgmm_tpu(x, y, starts, ends, out_dtype, st: _Static):
  tm, tk, tn = st.tiling
  m, p = x.shape
  q = y.shape[1]
  schedule = _visits_by_group(starts, ends, m // tm, tm)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=6, grid=(p // tk, q // tn, schedule[0].shape[0]),
      in_specs=[pl.BlockSpec((tm, tk), lambda i, j, v, t, *_: (t[v], i)),
                pl.BlockSpec((tm, tn), lambda i, j, v, t, *_: (t[v], j))],
      out_specs=pl.BlockSpec((None, tk, tn), lambda i, j, v, t, g, *_: (g[v], i, j)),
      scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)])
  return pl.pallas_call(
      _tgmm_tpu_kernel, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((starts.shape[0], p, q), out_dtype),
      compiler_params=common.compiler_params(st.where, ("parallel", "parallel", "arbitrary")),
      interpret=st.where == "interpret")(*schedule, x, y)


# ------------------------------------------------------------------------------ GPU kernels
def _gmm_gpu_kernel(g_first_ref, g_last_ref, start_ref, end_ref, lhs_ref, rhs_ref, out_ref, *, tk,
                    transpose_rhs):
  j, t = pl.program_id(0), pl.program_id(1)
  tm, tn = out_ref.shape
  rows = t * tm + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)

  def one_group(g, out):
    def k_step(kk, acc):
      k0 = pl.multiple_of(kk * tk, tk)
      x = lhs_ref[:, pl.ds(k0, tk)]
      if transpose_rhs:
        return acc + lax.dot_general(x, rhs_ref[g, pl.ds(j * tn, tn), pl.ds(k0, tk)], NT,
                                     preferred_element_type=jnp.float32)
      return acc + jnp.dot(x, rhs_ref[g, pl.ds(k0, tk), pl.ds(j * tn, tn)], preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, lhs_ref.shape[1] // tk, k_step, jnp.zeros((tm, tn), jnp.float32))
    return jnp.where((rows >= start_ref[g]) & (rows < end_ref[g]), acc, out)

  out = lax.fori_loop(g_first_ref[t], g_last_ref[t] + 1, one_group, jnp.zeros((tm, tn), jnp.float32))
  out_ref[...] = out.astype(out_ref.dtype)


def _tgmm_gpu_kernel(start_ref, end_ref, x_ref, y_ref, out_ref, *, tm):
  i, j, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  tk, tn = out_ref.shape
  start, end = start_ref[g], end_ref[g]

  def tile_step(t, acc):
    r0 = pl.multiple_of(t * tm, tm)
    rows = r0 + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    mine = (rows >= start) & (rows < end)
    x = x_ref[pl.ds(r0, tm), pl.ds(i * tk, tk)]
    y = y_ref[pl.ds(r0, tm), pl.ds(j * tn, tn)]
    x, y = jnp.where(mine, x, jnp.zeros_like(x)), jnp.where(mine, y, jnp.zeros_like(y))
    return acc + lax.dot_general(x, y, TN, preferred_element_type=jnp.float32)

  first = start // tm
  stop = jnp.where(end > start, lax.div(end + tm - 1, tm), first)
  out_ref[...] = lax.fori_loop(first, stop, tile_step, jnp.zeros((tk, tn), jnp.float32)).astype(out_ref.dtype)


def _gmm_gpu(lhs, rhs, starts, ends, out_dtype, st: _Static):
  tm, tk, tn = st.tiling
  m, k = lhs.shape
  n = rhs.shape[1] if st.transpose_rhs else rhs.shape[2]
  n_tiles = m // tm
  tile_lo = jnp.arange(n_tiles, dtype=jnp.int32) * tm
  a, z = jnp.maximum(tile_lo, starts[0]), jnp.minimum(tile_lo + tm, ends[-1])
  g_first = jnp.searchsorted(ends, a, side="right").astype(jnp.int32)
  g_last = jnp.where(a < z, jnp.searchsorted(ends, z - 1, side="right").astype(jnp.int32), g_first - 1)
  whole = lambda x: pl.BlockSpec(x.shape, lambda j, t: (0,) * x.ndim)
  return pl.pallas_call(
      functools.partial(_gmm_gpu_kernel, tk=tk, transpose_rhs=st.transpose_rhs),
      grid=(n // tn, n_tiles),
      in_specs=[whole(g_first), whole(g_last), whole(starts), whole(ends),
                pl.BlockSpec((tm, k), lambda j, t: (t, 0)), whole(rhs)],
      out_specs=pl.BlockSpec((tm, tn), lambda j, t: (t, j)),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      compiler_params=common.compiler_params(st.where, ("parallel", "parallel")),
      interpret=st.where == "interpret")(g_first, g_last, starts, ends, lhs, rhs)


def _tgmm_gpu(x, y, starts, ends, out_dtype, st: _Static):
  tm, tk, tn = st.tiling
  p, q = x.shape[1], y.shape[1]
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, g: (0,) * a.ndim)
  return pl.pallas_call(
      functools.partial(_tgmm_gpu_kernel, tm=tm),
      grid=(p // tk, q // tn, starts.shape[0]),
      in_specs=[whole(starts), whole(ends), whole(x), whole(y)],
      out_specs=pl.BlockSpec((None, tk, tn), lambda i, j, g: (g, i, j)),
      out_shape=jax.ShapeDtypeStruct((starts.shape[0], p, q), out_dtype),
      compiler_params=common.compiler_params(st.where, ("parallel",) * 3),
      interpret=st.where == "interpret")(starts, ends, x, y)


# ------------------------------------------------------------------------------ public API
def _static(m, k, n, tiling, interpret, formulation, transpose_rhs=False):
  """Tiles fitted to the shapes: tm shrinks for few rows, tk | K and tn | N."""
  where = common.target(interpret)
  formulation = formulation or ("gpu" if where == "gpu" else "tpu")
  tm, tk, tn = tiling or DEFAULT_TILING[where]
  tm = min(tm, common.next_pow2(m, MIN_ROWS[where]))
  return _Static((tm, common.divisor_block(k, tk), common.divisor_block(n, tn)), where, formulation,
                 transpose_rhs)


def _run_gmm(lhs, rhs, group_sizes, group_offset, out_dtype, st: _Static):
  m = lhs.shape[0]
  tm = st.tiling[0]
  lhs = common.pad_to(lhs, 0, max(common.cdiv(m, tm), 1) * tm)
  starts, ends = _local_bounds(group_sizes, group_offset, rhs.shape[0])
  run = _gmm_gpu if st.formulation == "gpu" else _gmm_tpu
  return run(lhs, rhs, starts, ends, out_dtype, st)[:m]


def _run_tgmm(x, y, group_sizes, group_offset, num_local, out_dtype, st: _Static):
  tm = st.tiling[0]
  rows = max(common.cdiv(x.shape[0], tm), 1) * tm
  x, y = common.pad_to(x, 0, rows), common.pad_to(y, 0, rows)
  starts, ends = _local_bounds(group_sizes, group_offset, num_local)
  run = _tgmm_gpu if st.formulation == "gpu" else _tgmm_tpu
  return run(x, y, starts, ends, out_dtype, st)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gmm(lhs, rhs, group_sizes, group_offset, st: _Static):
  return _run_gmm(lhs, rhs, group_sizes, group_offset, lhs.dtype, st)


def _gmm_fwd(lhs, rhs, group_sizes, group_offset, st):
  return _gmm(lhs, rhs, group_sizes, group_offset, st), (lhs, rhs, group_sizes, group_offset)


def _gmm_bwd(st, res, d_out):
  lhs, rhs, group_sizes, group_offset = res
  k = lhs.shape[1]
  n = d_out.shape[1]
  back = dataclasses.replace(st, transpose_rhs=not st.transpose_rhs,
                             tiling=(st.tiling[0], common.divisor_block(n, st.tiling[1]),
                                     common.divisor_block(k, st.tiling[2])))
  d_lhs = _run_gmm(d_out.astype(lhs.dtype), rhs, group_sizes, group_offset, lhs.dtype, back)
  if st.transpose_rhs:      # rhs [E, N, K]: d_rhs[e] = d_outᵀ · lhs
    x, y = d_out.astype(lhs.dtype), lhs
  else:                     # rhs [E, K, N]: d_rhs[e] = lhsᵀ · d_out
    x, y = lhs, d_out.astype(lhs.dtype)
  t_st = dataclasses.replace(st, tiling=(st.tiling[0], common.divisor_block(x.shape[1], st.tiling[1]),
                                         common.divisor_block(y.shape[1], st.tiling[2])))
  d_rhs = _run_tgmm(x, y, group_sizes, group_offset, rhs.shape[0], rhs.dtype, t_st)
  return d_lhs, d_rhs, None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_offset: int | jax.Array = 0, *,
        transpose_rhs: bool = False, tiling: tuple[int, int, int] | None = None,
        interpret: bool | None = None, formulation: str | None = None) -> jax.Array:
  """Grouped matmul, differentiable in lhs and rhs (see the module docstring).

  lhs: [m, K] rows sorted by group; rhs: [E_local, K, N] ([E_local, N, K] with
  transpose_rhs); group_sizes: [E] int (Σ ≤ m); group_offset: first group this shard
  holds (group_offset + E_local ≤ E). Returns [m, N] in lhs's dtype (float32 accumulation).
  `tiling` (tm, tk, tn) defaults per target; tk and tn shrink to divide K and N.
  """
  k = lhs.shape[1]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if (rhs.shape[2] if transpose_rhs else rhs.shape[1]) != k:
    raise ValueError(f"gmm: lhs {lhs.shape} and rhs {rhs.shape} disagree on K (transpose_rhs={transpose_rhs})")
  st = _static(lhs.shape[0], k, n, tiling, interpret, formulation, transpose_rhs)
  return _gmm(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), jnp.asarray(group_offset, jnp.int32), st)


def tgmm(x: jax.Array, y: jax.Array, group_sizes: jax.Array, num_local: int,
         group_offset: int | jax.Array = 0, *, tiling: tuple[int, int, int] | None = None,
         interpret: bool | None = None, formulation: str | None = None) -> jax.Array:
  """out[e] = Σ_{rows r of group group_offset+e} x[r]ᵀ y[r]: [m, P] × [m, Q] → [num_local, P, Q]."""
  st = _static(x.shape[0], x.shape[1], y.shape[1], tiling, interpret, formulation)
  return _run_tgmm(x, y.astype(x.dtype), group_sizes.astype(jnp.int32), jnp.asarray(group_offset, jnp.int32),
                   num_local, x.dtype, st)
