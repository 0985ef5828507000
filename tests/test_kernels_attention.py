"""Pallas MLA flash attention (interpreted) against `causal_attention`: values, max logits, gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_attention


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
}


@pytest.mark.parametrize("case", sorted(CASES))
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
