"""Pallas vision flash attention (interpreted) against `block_diagonal_attention`: values, gradients,
and the key blocks it visits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_attention, vision_attention


def _close(actual, expected, rtol):
  """Equal to `rtol` relative to the largest magnitude of `expected`."""
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


UNEVEN = np.repeat([1, 2, 3, 4, 0], [5, 30, 3, 25, 7]).astype(np.int32)      # 70: layout padding last
INTERLEAVED = np.repeat([2, 1, 2, 3, 1], [9, 6, 11, 4, 10]).astype(np.int32)  # 40: ids not contiguous
LARGE_IDS = np.repeat([10**6, 5, 10**6 + 1, 10**6], [12, 9, 14, 5]).astype(np.int32)  # 40: ids past s, pieces

# (segment ids, block_q, block_k, formulation, head dim, dtype, rtol values, rtol gradients)
CASES = {
    # segments of 3 to 30 patches cross the 16/8 blocks; 70 is no multiple of either
    "uneven_segments": (UNEVEN, 16, 8, "tpu", 8, jnp.float32, 1e-5, 1e-5),
    "uneven_keys_wider": (UNEVEN, 8, 32, "tpu", 8, jnp.float32, 1e-5, 1e-5),
    "one_segment": (np.ones(40, np.int32), 16, 16, "tpu", 8, jnp.float32, 1e-5, 1e-5),
    "interleaved_ids": (INTERLEAVED, 8, 8, "tpu", 8, jnp.float32, 1e-5, 1e-5),
    "large_ids": (LARGE_IDS, 8, 8, "tpu", 8, jnp.float32, 1e-5, 1e-5),
    "gpu_padded_heads": (UNEVEN, 16, 16, "gpu", 12, jnp.float32, 1e-5, 1e-5),
    "bf16": (UNEVEN, 16, 8, "tpu", 8, jnp.bfloat16, 1e-2, 2e-2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_flash_attention_equals_xla(case):
  segments, bq, bk, formulation, dim, dtype, rtol, grad_rtol = CASES[case]
  rng = np.random.default_rng(len(segments))
  q, k, v = (jnp.asarray(rng.normal(size=(len(segments), 3, dim)), dtype) for _ in range(3))
  segments = jnp.asarray(segments)

  def kernel(q, k, v):
    return vision_attention.flash_attention(q, k, v, segments, block_q=bq, block_k=bk, formulation=formulation)

  def reference(q, k, v):
    return vision_attention.reference(q, k, v, segments)

  _close(kernel(q, k, v), reference(q, k, v), rtol)

  def loss(fn):   # a weighting that differs per position, so every gradient entry is exercised
    return lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32)))

  grads = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
  ref_grads = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(grads, ref_grads):
    _close(g, r, grad_rtol)


def _sharing(seg, own, other):
  """[blocks of `own`, blocks of `other`]: whether the two blocks hold a common segment."""
  own_sets = [set(seg[i:i + own]) for i in range(0, len(seg), own)]
  other_sets = [set(seg[j:j + other]) for j in range(0, len(seg), other)]
  return np.array([[bool(a & b) for b in other_sets] for a in own_sets])


@pytest.mark.parametrize("seg, bq, bk", [(UNEVEN, 16, 8), (UNEVEN, 8, 32), (INTERLEAVED, 8, 8),
                                         (LARGE_IDS, 8, 8)])
def test_spans_hold_every_block_sharing_a_segment(seg, bq, bk):
  """Both passes' spans (query blocks over key blocks, key blocks over query blocks)."""
  padded = np.pad(seg, (0, -len(seg) % 32), constant_values=flash_attention.PAD_SEGMENT)
  spans = [np.asarray(x)[0] for x in flash_attention._segment_spans(jnp.asarray(padded)[None], bq, bk)]
  for (lo, hi), own, other in ((spans[:2], bq, bk), (spans[2:], bk, bq)):
    blocks = np.arange(len(padded) // other)
    visited = (blocks[None] >= lo[:, None]) & (blocks[None] <= hi[:, None])
    sharing = _sharing(padded, own, other)
    assert not np.any(sharing & ~visited)
    if seg is UNEVEN:                            # contiguous segments: exactly those blocks
      np.testing.assert_array_equal(visited, sharing)


def test_many_small_images_skip_most_tiles():
  """64 images of 256 patches at blocks (256, 512): each query block visits 1 of 32 key blocks,
  each key block 2 of 64 query blocks."""
  seg = jnp.repeat(jnp.arange(1, 65, dtype=jnp.int32), 256)[None]
  k_lo, k_hi, q_lo, q_hi = flash_attention._segment_spans(seg, 256, 512)
  np.testing.assert_array_equal(k_hi - k_lo, 0)
  np.testing.assert_array_equal(q_hi - q_lo, 1)


@pytest.mark.parametrize("formulation", ["tpu", "gpu"])
def test_batch_rows_read_their_own_spans(formulation):
  """The segment mode of the shared kernels over [b, s, h, d] with a different layout per row."""
  rng = np.random.default_rng(1)
  segments = jnp.asarray(np.stack([UNEVEN, UNEVEN[::-1]]))
  q, k, v = (jnp.asarray(rng.normal(size=(2, 70, 2, 8)), jnp.float32) for _ in range(3))
  out, _ = flash_attention.flash_attention(q, k, v, 8 ** -0.5, segments, causal=False, block_q=16, block_k=8,
                                           formulation=formulation)
  _close(out, jax.vmap(vision_attention.reference)(q, k, v, segments), 1e-5)
