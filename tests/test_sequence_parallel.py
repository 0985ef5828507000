"""The Pallas flash kernels under a mesh (k25jax.model.sequence_parallel): decoder rows split along `sequence`,
the vision tower's packed sequence per data shard."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import PartitionSpec as P

from k25jax.model import sequence_parallel
from k25jax.train import sharding
from pallas_kernels import mla_attention, vision_attention

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


def _vision_inputs(shards=2, patches=48, heads=4):
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(shards, patches, heads, 8)), jnp.float32) for _ in range(3))
  segments = np.zeros((shards, patches), np.int32)     # shard 0: two items and padding; shard 1: one item
  segments[0, :20], segments[0, 20:40], segments[1] = 1, 2, 1
  return q, k, v, jnp.asarray(segments)


def test_vision_kernel_per_data_shard_equals_the_reference_and_gathers_nothing():
  """Media in 2 shards on data 2 × sequence 2 × tensor 2: the vmap over shards splits over the batch axes,
  each device runs the kernel on its shard's whole sequence of 2 of the 4 heads; values and
  gradients equal the XLA reference, and no device gathers another shard's q, k or v."""
  q, k, v, segments = _vision_inputs()
  kernel = lambda *a: vision_attention.flash_attention(*a, block_q=16, block_k=16)

  def loss(attention, spmd):
    def total(q, k, v, segments):
      out = jax.vmap(attention, spmd_axis_name=spmd)(q, k, v, segments)
      return jnp.sum(jnp.sin(out))
    return total

  grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2))
  mesh = sharding.make_mesh(dict(data=2, sequence=2, tensor=2))
  args = jax.device_put((q, k, v, segments), jax.sharding.NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    spmd = sequence_parallel.shard_axes(2)
    assert spmd == ("data",) and sequence_parallel.shard_axes(3) is None
    step = jax.jit(grad(loss(lambda *a: sequence_parallel.vision_head_split_attention(kernel, *a), spmd)))
    value, grads = step(*args)
    hlo = step.lower(*args).compile().as_text()
  ref_value, ref_grads = grad(loss(vision_attention.reference, None))(q, k, v, segments)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
  assert "f32[2,48,4,8]" not in hlo and "all-gather" not in hlo


def test_vision_heads_that_do_not_divide_over_tensor_are_refused():
  q, k, v, segments = _vision_inputs(heads=3)
  with jax.set_mesh(sharding.make_mesh(dict(data=4, tensor=2))), nn.logical_axis_rules(sharding.RULES):
    with pytest.raises(ValueError, match="vision attention: 3 heads do not divide"):
      jax.eval_shape(lambda *a: sequence_parallel.vision_head_split_attention(vision_attention.flash_attention, *a),
                     q[0], k[0], v[0], segments[0])


def _decode_inputs(rows=4, t=2, heads=4, slots=256):
  rng = np.random.default_rng(2)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  positions = jnp.asarray(rng.integers(t, slots, size=(rows, 1)) - np.arange(t)[::-1], jnp.int32)
  return normal(rows, t, heads, 16), normal(rows, t, heads, 8), normal(rows, slots, 16), normal(rows, slots, 8), positions


def test_decode_kernel_on_each_devices_rows_equals_the_reference_and_gathers_no_cache():
  """The latent cache's 4 rows over data 2 × fsdp 2, the 4 heads over tensor 2: each device
  decodes its own row against its own cache row; out and the per-head max logit equal the XLA
  reference, and no device holds the whole cache."""
  from pallas_kernels import mla_decode
  args = _decode_inputs()
  mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
  rows = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, P(("data", "fsdp"))))
  placed = tuple(rows(x) for x in args)
  with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    step = jax.jit(lambda *a: sequence_parallel.row_split_decode_attention(mla_decode.latent_attention, *a, 0.3))
    out, max_logits = step(*placed)
    hlo = step.lower(*placed).compile().as_text()
  ref_out, ref_max = mla_decode.reference(*args, 0.3)
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(max_logits, ref_max, rtol=1e-6)
  assert "f32[4,256,16]" not in hlo and "all-gather" not in hlo


def test_decode_rows_that_do_not_divide_over_the_batch_axes_are_refused():
  from pallas_kernels import mla_decode
  args = _decode_inputs(rows=2)
  with jax.set_mesh(sharding.make_mesh(dict(data=4, tensor=2))), nn.logical_axis_rules(sharding.RULES):
    with pytest.raises(ValueError, match="latent decode attention: 2 rows do not divide"):
      jax.eval_shape(lambda *a: sequence_parallel.row_split_decode_attention(mla_decode.latent_attention, *a, 0.3),
                     *args)
