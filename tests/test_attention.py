"""MLA attention: chunked causal attention against a brute-force reference; packing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k25jax.model import attention, config, transformer


def _reference(q, k, v, scale, segment_ids):
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  s = q.shape[1]
  mask = np.tril(np.ones((s, s), bool))[None, None]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  masked = np.where(mask, logits, -np.inf)
  probs = np.exp(masked - masked.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  valid = mask if segment_ids is None else mask & (segment_ids[:, None, :, None] > 0)
  return np.einsum("bhqk,bkhd->bqhd", probs, v), np.where(valid, logits, -np.inf).max(axis=(0, 2, 3))


@pytest.mark.parametrize("seq, chunk, segmented", [(64, 16, False), (64, 16, True), (50, 16, True), (32, 32, False)])
def test_chunked_attention_matches_reference(seq, chunk, segmented):
  rng = np.random.default_rng(seq + chunk)
  q, k = rng.normal(size=(2, 2, seq, 3, 12)).astype(np.float32)
  v = rng.normal(size=(2, seq, 3, 8)).astype(np.float32)
  segment_ids = None
  if segmented:  # three documents in row 0 and trailing padding in row 1
    segment_ids = np.ones((2, seq), np.int32)
    segment_ids[0, seq // 3:] = 2
    segment_ids[0, 2 * seq // 3:] = 3
    segment_ids[1, seq - 7:] = 0
  out, max_logits = attention.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 0.3,
                                               None if segment_ids is None else jnp.asarray(segment_ids), chunk)
  ref_out, ref_max = _reference(q, k, v, 0.3, segment_ids)
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(max_logits, ref_max, rtol=1e-5)


def _jnp_reference_output(q, k, v, scale, segment_ids):
  """The brute-force masked softmax in jax.numpy, differentiated by autodiff."""
  s = q.shape[1]
  mask = jnp.tril(jnp.ones((s, s), bool))[None, None] & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  logits = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


@pytest.mark.parametrize("seq, chunk, dtype", [(48, 16, jnp.float32), (40, 16, jnp.float32), (32, 16, jnp.bfloat16)])
def test_chunked_attention_gradients_match_autodiff_of_reference(seq, chunk, dtype):
  """The written-out backward equals autodiff of the brute-force softmax, packed documents and padding included."""
  rng = np.random.default_rng(seq)
  q, k = (jnp.asarray(x, dtype) for x in rng.normal(size=(2, 2, seq, 3, 12)))
  v, cotangent = (jnp.asarray(x, dtype) for x in rng.normal(size=(2, 2, seq, 3, 8)))
  segment_ids = np.ones((2, seq), np.int32)
  segment_ids[0, seq // 2:] = 2
  segment_ids[1, seq - 5:] = 0
  segment_ids = jnp.asarray(segment_ids)
  ours = jax.grad(lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v, 0.3, segment_ids, chunk)[0]
                                          .astype(jnp.float32) * cotangent), argnums=(0, 1, 2))(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  ref = jax.grad(lambda q, k, v: jnp.sum(_jnp_reference_output(q, k, v, 0.3, segment_ids) * f32(cotangent)),
                 argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
  tol = 1e-5 if dtype == jnp.float32 else 5e-2
  for got, want in zip(ours, ref):
    assert got.dtype == dtype
    np.testing.assert_allclose(f32(got), want, rtol=tol, atol=tol)


def test_packed_documents_equal_separate_runs():
  cfg = config.preset("tiny", vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                      n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64)
  model = transformer.Transformer(cfg)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  doc_a, doc_b = rng.integers(0, 64, 11), rng.integers(0, 64, 7)
  packed = np.concatenate([doc_a, doc_b, np.zeros(6, int)])[None]
  segments = np.array([[1] * 11 + [2] * 7 + [0] * 6])
  positions = np.array([list(range(11)) + list(range(7)) + [0] * 6])
  apply = jax.jit(model.apply)     # compiled: op-by-op dispatch of the whole decoder takes ~10x longer
  logits, _ = apply({"params": params}, jnp.asarray(packed), jnp.asarray(positions), jnp.asarray(segments))
  alone_a, _ = apply({"params": params}, jnp.asarray(doc_a[None]))
  alone_b, _ = apply({"params": params}, jnp.asarray(doc_b[None]))
  np.testing.assert_allclose(logits[0, :11], alone_a[0], atol=1e-5)
  np.testing.assert_allclose(logits[0, 11:18], alone_b[0], atol=1e-5)
