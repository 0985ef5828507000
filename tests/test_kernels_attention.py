"""Pallas MLA flash attention (interpreted) against `causal_attention`: values, max logits, gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import common, mla_attention


def _close(actual, expected, rtol):
  """Equal to `rtol` relative to the largest magnitude of `expected`."""
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


def _inputs(seq, dtype, segmented, heads=3, dqk=48, dv=32):
  rng = np.random.default_rng(seq)
  q, k = (jnp.asarray(rng.normal(size=(2, seq, heads, dqk)), dtype) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(2, seq, heads, dv)), dtype)
  if not segmented:
    return q, k, v, None
  segments = np.ones((2, seq), np.int32)        # row 0: three documents; row 1: trailing padding
  segments[0, seq // 3:] = 2
  segments[0, 2 * seq // 3:] = 3
  segments[1, seq - 5:] = 0
  return q, k, v, jnp.asarray(segments)


# (seq, block_q, block_k, segmented, formulation, dtype, rtol values, rtol gradients)
CASES = {
    "ragged_seq_segments": (40, 16, 8, True, "tpu", jnp.float32, 1e-5, 1e-5),
    "one_block_no_segments": (16, 16, 16, False, "tpu", jnp.float32, 1e-5, 1e-5),
    "gpu_padded_heads": (24, 8, 16, True, "gpu", jnp.float32, 1e-5, 1e-5),
    "bf16": (24, 8, 8, True, "tpu", jnp.bfloat16, 1e-2, 2e-2),   # measured 5e-3, 7.5e-3
    # K tiling on: several key blocks per query block, the length not a multiple of the block
    "tiled_200_blocks_64": (200, 64, 64, True, "tpu", jnp.float32, 1e-5, 1e-5),
    "tiled_256_keys_narrower": (256, 64, 32, True, "tpu", jnp.float32, 1e-5, 1e-5),
    "tiled_200_keys_wider": (200, 64, 128, True, "tpu", jnp.float32, 1e-5, 1e-5),
}


@pytest.mark.parametrize("case", sorted(CASES))   # its slowest: full suite only (conftest.SLOW_IN_THE_INNER_LOOP)
def test_flash_attention_equals_xla(case):
  seq, bq, bk, segmented, formulation, dtype, rtol, grad_rtol = CASES[case]
  q, k, v, segments = _inputs(seq, dtype, segmented)
  scale = 48 ** -0.5 * 1.3

  def kernel(q, k, v):
    return mla_attention.flash_attention(q, k, v, scale, segments, block_q=bq, block_k=bk,
                                         formulation=formulation)

  def reference(q, k, v):
    return mla_attention.reference(q, k, v, scale, segments)

  out, max_logits = kernel(q, k, v)
  ref_out, ref_max = reference(q, k, v)
  _close(out, ref_out, rtol)
  _close(max_logits, ref_max, rtol)

  def loss(fn):   # a weighting that differs per position, so every gradient entry is exercised
    return lambda *a: jnp.sum(jnp.sin(fn(*a)[0].astype(jnp.float32)))

  grads = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
  ref_grads = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(grads, ref_grads):
    _close(g, r, grad_rtol)


def test_padding_queries_are_left_out_of_the_max():
  q, k, v, _ = _inputs(16, jnp.float32, False)
  segments = jnp.asarray(np.array([[1] * 10 + [0] * 6] * 2))
  q = q.at[:, 10:].multiply(100.0)               # huge logits on padding rows only
  _, max_logits = mla_attention.flash_attention(q, k, v, 0.2, segments, block_q=8, block_k=8)
  _, ref_max = mla_attention.reference(q, k, v, 0.2, segments)
  _close(max_logits, ref_max, 1e-5)
  assert float(jnp.max(max_logits)) < 50.0


def test_tpu_blocks_do_not_grow_with_the_sequence(monkeypatch):
  """At 32K tokens (K2.5 head dims), every block a program holds is at most a block of rows."""
  shapes, pallas_call = [], pl.pallas_call

  def recording(*args, in_specs, out_specs, **kwargs):
    specs = [*in_specs, *(out_specs if isinstance(out_specs, list) else [out_specs])]
    shapes.extend(s.block_shape for s in specs)
    return pallas_call(*args, in_specs=in_specs, out_specs=out_specs, **kwargs)

  monkeypatch.setattr(pl, "pallas_call", recording)
  seq, block = 32768, 512
  S = jax.ShapeDtypeStruct
  fn = lambda q, k, v: jnp.sum(mla_attention.flash_attention(q, k, v, 0.1, block_q=256, block_k=block)[0])
  jax.eval_shape(jax.grad(fn, argnums=(0, 1, 2)), S((1, seq, 2, 192), jnp.bfloat16),
                 S((1, seq, 2, 192), jnp.bfloat16), S((1, seq, 2, 128), jnp.bfloat16))
  assert len(shapes) == 8 + 10 + 9                          # forward, dK/dV, dQ
  assert max(d for shape in shapes for d in shape if d is not None) == block


def test_the_tiled_formulation_is_refused_on_a_gpu(monkeypatch):
  monkeypatch.setattr(common, "target", lambda interpret=None: "gpu")
  q, k, v, _ = _inputs(16, jnp.float32, False)
  with pytest.raises(ValueError, match="Triton has no scratch"):
    mla_attention.flash_attention(q, k, v, 0.2, formulation="tpu")
