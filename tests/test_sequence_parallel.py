"""The Pallas MLA flash kernel under a mesh (k25jax.model.sequence_parallel): rows split along `sequence`."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k25jax.model import sequence_parallel
from k25jax.train import sharding
from pallas_kernels import mla_attention

ACTIVATION = ("activation_batch", "activation_length", "activation_heads", None)


def _inputs(heads=4, seq=64):
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.normal(size=(4, seq, heads, 24)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(4, seq, heads, 16)), jnp.float32)
  segments = np.ones((4, seq), np.int32)     # row 0: two documents split across the sequence shards; row 1: padding
  segments[0, 20:] = 2
  segments[1, 50:] = 0
  return q, k, v, jnp.asarray(segments)


def _loss(attention):
  """(Σ sin(out), max_logits) of the attention of constrained q, k, v: a weighting that differs per position."""
  def loss(q, k, v, segments):
    out, max_logits = attention(*(nn.with_logical_constraint(x, ACTIVATION) for x in (q, k, v)), 0.3, segments)
    return jnp.sum(jnp.sin(out)), max_logits
  return loss


def test_rows_split_over_sequence_equal_the_unsharded_kernel():
  """fsdp 2 × sequence 2 × tensor 2: each device holds whole rows of 1 of the 4 heads; the
  values, max logits and gradients equal the XLA reference on one device."""
  q, k, v, segments = _inputs()
  kernel = lambda *a: mla_attention.flash_attention(*a, block_q=16, block_k=16)
  sharded = _loss(lambda *a: sequence_parallel.head_split_attention(kernel, *a))
  grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)
  with jax.set_mesh(sharding.make_mesh(dict(fsdp=2, sequence=2, tensor=2))), nn.logical_axis_rules(sharding.RULES):
    step = jax.jit(grad(sharded))
    (loss, max_logits), grads = step(q, k, v, segments)
    hlo = step.lower(q, k, v, segments).compile().as_text()
  (ref_loss, ref_max), ref_grads = grad(_loss(mla_attention.reference))(q, k, v, segments)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(max_logits, ref_max, rtol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
  assert "all-to-all" in hlo                 # sequence → heads and back, not an all-gather of the rows


def test_heads_that_do_not_divide_over_sequence_and_tensor_are_refused():
  q, k, v, segments = _inputs(heads=3)
  with jax.set_mesh(sharding.make_mesh(dict(fsdp=2, sequence=2, tensor=2))), nn.logical_axis_rules(sharding.RULES):
    with pytest.raises(ValueError, match="3 heads do not divide"):
      jax.eval_shape(lambda *a: sequence_parallel.head_split_attention(mla_attention.flash_attention, *a),
                     q, k, v, 0.3, segments)
