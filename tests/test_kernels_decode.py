"""Pallas latent-cache decode attention (interpreted) against the XLA core of `MLA.decode`."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_decode


def _close(actual, expected, rtol):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


def _inputs(positions, cache_len, dtype, heads=4, c=64, r=16):
  b, t = positions.shape
  rng = np.random.default_rng(cache_len)
  return (jnp.asarray(rng.normal(size=(b, t, heads, c)), dtype), jnp.asarray(rng.normal(size=(b, t, heads, r)), dtype),
          jnp.asarray(rng.normal(size=(b, cache_len, c)), dtype), jnp.asarray(rng.normal(size=(b, cache_len, r)), dtype),
          jnp.asarray(positions, jnp.int32))


# (positions [b, t], cache length, chunk, block_s, block_rows, formulation, dtype, rtol)
CASES = {
    "length_1": ([[0], [0]], 64, 32, 16, None, "tpu", jnp.float32, 1e-5),
    "full_cache": ([[63], [63]], 64, 32, 16, None, "tpu", jnp.float32, 1e-5),
    "mixed_rows_two_tokens_ragged_cache": ([[0, 1], [40, 41], [98, 99]], 100, 64, 16, 4, "tpu", jnp.float32, 1e-5),
    "gpu_mixed_rows": ([[5], [99]], 100, 32, 8, None, "gpu", jnp.float32, 1e-5),
    "bf16_mixed_rows": ([[3], [77]], 128, 64, 32, None, "tpu", jnp.bfloat16, 1e-2),   # measured 6.6e-3
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_latent_decode_equals_xla(case):
  positions, cache_len, chunk, block_s, block_rows, formulation, dtype, rtol = CASES[case]
  args = _inputs(np.array(positions), cache_len, dtype)
  out, max_logits = mla_decode.latent_attention(*args, 0.17, chunk=chunk, block_s=block_s, block_rows=block_rows,
                                                formulation=formulation)
  ref_out, ref_max = mla_decode.reference(*args, 0.17)
  assert out.dtype == dtype and out.shape == ref_out.shape
  _close(out, ref_out, rtol)
  _close(max_logits, ref_max, rtol)


def test_slots_past_the_position_are_ignored():
  args = list(_inputs(np.array([[10]]), 64, jnp.float32))
  out, _ = mla_decode.latent_attention(*args, 0.17, chunk=32, block_s=16)
  args[2] = args[2].at[:, 11:].set(1e4)           # garbage in the unwritten slots
  args[3] = args[3].at[:, 11:].set(jnp.nan)
  again, _ = mla_decode.latent_attention(*args, 0.17, chunk=32, block_s=16)
  np.testing.assert_array_equal(out, again)
