"""MLA decode attention read straight from the compressed (latent) cache.

The cache keeps per token only the normed latent c_j (kv_lora = 512) and the rotated
rope key k_j (64), shared by all heads. With kv_b absorbed into the query
(q_lat = W_uk q_nope, computed outside), every head of every new token is one query
row against the same keys, so a batch row is a multi-query attention problem:

    s_ij  = scale · (q_lat,i · c_j + q_rope,i · k_j)      visible(i, j) = j ≤ pos_i
    o_i   = Σ_j p_ij c_j,   p = softmax_j(s) over visible j       (then W_uv outside)

Rows i = (token t, head h) of one batch row; pos_i = positions[b, t].

Split-K ("flash decoding"): program (b, row block, split) walks its split's `chunk`
cache slots in steps of `block_s`, stopping after the row's last visible slot, and
keeps the online-softmax state (M, ℓ, acc) in float32. The splits merge outside:

    M = max_s M_s,   o_i = Σ_s e^{M_s−M} acc_s / Σ_s e^{M_s−M} ℓ_s,

and the per-head max logit (QK-Clip) is max over b, splits and tokens of M_s.
On TPU the split's cache block index is clamped to the row's last split (scalar
prefetch), so no slot beyond the longest visible position is copied in; Triton loads
lazily, so the in-kernel stop is enough there. Inference only: no VJP.
The XLA reference is the core of `k25jax.model.attention.MLA.decode`.
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

# (chunk: slots per program, block_s: slots per step, block_rows: query rows per program; 0 = all)
DEFAULT_BLOCKS = {"tpu": (2048, 512, 0), "gpu": (1024, 64, 16), "interpret": (256, 128, 0)}


def reference(q_latent, q_rope, latent, k_rope, positions, scale):
  """XLA: the latent-cache core of `MLA.decode` → (out_latent [b,t,h,c], max_logits [h])."""
  dtype = q_latent.dtype
  logits = (jnp.einsum("bthc,bsc->bhts", q_latent, latent.astype(dtype), preferred_element_type=jnp.float32)
            + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope.astype(dtype), preferred_element_type=jnp.float32)
            ) * scale
  visible = jnp.arange(latent.shape[1])[None, None, None, :] <= positions[:, None, :, None]
  logits = jnp.where(visible, logits, -jnp.inf)
  max_logits = jnp.max(logits, axis=(0, 2, 3))
  probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
  return jnp.einsum("bhts,bsc->bthc", probs, latent.astype(dtype)), max_logits


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  chunk: int
  block_s: int


def _kernel(last_ref, q_lat_ref, q_rope_ref, pos_ref, latent_ref, k_rope_ref, acc_ref, m_ref, l_ref, *,
            st: _Static):
  chunk_start = pl.program_id(2) * st.chunk
  last = last_ref[pl.program_id(0)]                           # the row's last visible slot
  n_steps = jnp.clip(lax.div(last - chunk_start + st.block_s, st.block_s), 0, st.chunk // st.block_s)
  q_lat, q_rope, pos = q_lat_ref[...], q_rope_ref[...], pos_ref[...]
  dtype = q_lat.dtype

  def step(j, carry):
    m, l, acc = carry
    start = pl.multiple_of(j * st.block_s, st.block_s)
    c = latent_ref[pl.ds(start, st.block_s), :].astype(dtype)
    k = k_rope_ref[pl.ds(start, st.block_s), :].astype(dtype)
    nt = (((1,), (1,)), ((), ()))
    s = (lax.dot_general(q_lat, c, nt, preferred_element_type=jnp.float32)
         + lax.dot_general(q_rope, k, nt, preferred_element_type=jnp.float32)) * st.scale
    slot = chunk_start + start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(slot <= pos, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m - m_safe)
    return (m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True),
            alpha * acc + jnp.dot(p.astype(dtype), c, preferred_element_type=jnp.float32))

  rows = q_lat.shape[0]
  init = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
          jnp.zeros((rows, q_lat.shape[1]), jnp.float32))
  m, l, acc = lax.fori_loop(0, n_steps, step, init)
  acc_ref[...], m_ref[...], l_ref[...] = acc, m, l


def latent_attention(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                     positions: jax.Array, scale: float, *, chunk: int | None = None,
                     block_s: int | None = None, block_rows: int | None = None,
                     interpret: bool | None = None, formulation: str | None = None
                     ) -> tuple[jax.Array, jax.Array]:
  """Decode attention over the latent cache (same contract as `reference`).

  q_latent: [b, t, h, c]; q_rope: [b, t, h, r]; latent: [b, S, c]; k_rope: [b, S, r];
  positions: [b, t] int (query (b, t) sees slots ≤ positions[b, t]). Returns
  (out_latent [b, t, h, c] in q's dtype, max_logits [h] float32). `chunk` slots per
  program (a multiple of `block_s`), `block_rows` query rows per program (0 = all t·h).
  A cache length that is not a multiple of `block_s` is padded (a copy): size caches
  in whole blocks. `formulation` "gpu" pads rows to a power of two as Triton needs.
  """
  where = common.target(interpret)
  formulation = formulation or ("gpu" if where == "gpu" else "tpu")
  b, t, h, c = q_latent.shape
  r, cache_len = q_rope.shape[-1], latent.shape[1]
  default_chunk, default_bs, default_rows = DEFAULT_BLOCKS[where]
  bs = min(block_s or default_bs, common.next_pow2(cache_len, 8))
  padded_len = common.cdiv(cache_len, bs) * bs
  chunk = max(bs, min(chunk or default_chunk, padded_len) // bs * bs)
  while padded_len % chunk:                                   # a whole number of chunks
    chunk -= bs
  latent, k_rope = common.pad_to(latent, 1, padded_len), common.pad_to(k_rope, 1, padded_len)
  n_splits = padded_len // chunk

  rows = t * h
  rows_padded = common.next_pow2(rows, 16) if formulation == "gpu" else rows
  br = min(block_rows if block_rows is not None else default_rows, rows_padded) or rows_padded
  rows_padded = common.cdiv(rows_padded, br) * br
  q_lat = common.pad_to(q_latent.reshape(b, rows, c), 1, rows_padded)
  q_rp = common.pad_to(q_rope.astype(q_latent.dtype).reshape(b, rows, r), 1, rows_padded)
  pos = common.pad_to(jnp.repeat(positions.astype(jnp.int32), h, axis=1), 1, rows_padded, value=-1)[..., None]
  last = jnp.max(positions, axis=1).astype(jnp.int32)
  st = _Static(float(scale), chunk, bs)

  grid = (b, rows_padded // br, n_splits)
  if formulation == "tpu":
    cache_map = lambda bi, ri, si, last_ref: (bi, jnp.minimum(si, lax.div(last_ref[bi], chunk)), 0)
    row_map = lambda bi, ri, si, last_ref: (bi, ri, 0)
    out_map = lambda bi, ri, si, last_ref: (bi, si, ri, 0)
  else:
    cache_map = lambda bi, ri, si: (bi, si, 0)
    row_map = lambda bi, ri, si: (bi, ri, 0)
    out_map = lambda bi, ri, si: (bi, si, ri, 0)
  in_specs = [pl.BlockSpec((None, br, c), row_map), pl.BlockSpec((None, br, r), row_map),
              pl.BlockSpec((None, br, 1), row_map),
              pl.BlockSpec((None, chunk, c), cache_map), pl.BlockSpec((None, chunk, r), cache_map)]
  out_specs = [pl.BlockSpec((None, None, br, c), out_map), pl.BlockSpec((None, None, br, 1), out_map),
               pl.BlockSpec((None, None, br, 1), out_map)]
  stat = jax.ShapeDtypeStruct((b, n_splits, rows_padded, 1), jnp.float32)
  out_shape = [jax.ShapeDtypeStruct((b, n_splits, rows_padded, c), jnp.float32), stat, stat]
  kernel = functools.partial(_kernel, st=st)
  if formulation == "tpu":
    call = pl.pallas_call(kernel, grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_specs),
        out_shape=out_shape, compiler_params=common.compiler_params(where, ("parallel",) * 3),
        interpret=where == "interpret")
  else:
    call = pl.pallas_call(kernel, grid=grid, in_specs=[pl.BlockSpec((b,), lambda bi, ri, si: (0,))] + in_specs,
                          out_specs=out_specs, out_shape=out_shape,
                          compiler_params=common.compiler_params(where, ("parallel",) * 3),
                          interpret=where == "interpret")
  acc, m, l = call(last, q_lat, q_rp, pos, latent, k_rope)

  # Merge the splits: o = Σ_s e^{M_s−M} acc_s / Σ_s e^{M_s−M} ℓ_s.
  acc, m, l = acc[:, :, :rows], m[:, :, :rows], l[:, :, :rows]
  m_all = jnp.max(m, axis=1, keepdims=True)
  w = jnp.exp(m - jnp.where(m_all == -jnp.inf, 0.0, m_all))
  out = jnp.sum(w * acc, axis=1) / jnp.sum(w * l, axis=1)
  max_logits = jnp.max(m.reshape(b, n_splits, t, h), axis=(0, 1, 2))
  return out.reshape(b, t, h, c).astype(q_latent.dtype), max_logits
