"""k25jax.losses.next_token_loss against a NumPy reference; head_next_token_loss against it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k25jax import losses


def reference(logits, targets, weights, z_loss):
  logits = logits.astype(np.float64)
  m = logits.max(-1, keepdims=True)
  log_z = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
  target = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  per_token = log_z - target + z_loss * log_z ** 2
  return (weights * per_token).sum() / weights.sum()


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_matches_numpy_with_mask(z_loss):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 11)).astype(np.float32) * 4
  targets = rng.integers(0, 11, size=(3, 5))
  weights = (rng.random((3, 5)) > 0.4).astype(np.float32)
  loss, metrics = losses.next_token_loss(logits, targets, weights, z_loss=z_loss)
  np.testing.assert_allclose(loss, reference(logits, targets, weights, z_loss), rtol=1e-5)
  assert float(metrics["tokens"]) == weights.sum()


def test_masked_positions_do_not_count():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 4, 7)).astype(np.float32)
  targets = rng.integers(0, 7, size=(2, 4))
  weights = np.ones((2, 4), np.float32)
  weights[:, 2:] = 0
  garbage = logits.copy()
  garbage[:, 2:] = 1e4 * rng.normal(size=(2, 2, 7))
  a, _ = losses.next_token_loss(logits, targets, weights)
  b, _ = losses.next_token_loss(garbage, targets, weights)
  np.testing.assert_allclose(a, b, rtol=1e-6)


def test_accuracy_and_perfect_prediction():
  targets = np.array([[1, 2, 0]])
  logits = np.full((1, 3, 4), -30.0, np.float32)
  logits[0, np.arange(3), targets[0]] = 30.0
  logits[0, 2] = [0, 0, 0, 30.0]            # last token wrong but masked out
  loss, metrics = losses.next_token_loss(logits, targets, np.array([[1.0, 1.0, 0.0]]))
  assert float(loss) < 1e-6
  assert float(metrics["accuracy"]) == 1.0


def test_first_argmax_is_argmax_ties_included():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.integers(0, 3, size=(6, 5, 7)).astype(np.float32))   # many ties
  np.testing.assert_array_equal(losses.first_argmax(logits), jnp.argmax(logits, axis=-1))
  row = jnp.asarray([[0.0, jnp.nan, 1.0]])
  assert int(losses.first_argmax(row)[0]) == 3     # a NaN row matches no target


@pytest.mark.parametrize("z_loss,chunk_bytes,dtype", [(0.0, 2 * 3 * 13 * 4, jnp.float32),   # 2-token chunks
                                                      (1e-2, 5 * 3 * 13 * 4, jnp.float32),  # one chunk: 5 does not divide 6
                                                      (1e-2, 1, jnp.bfloat16)])             # 1-token chunks
def test_head_loss_equals_the_loss_of_the_logits_values_gradients_and_hits(z_loss, chunk_bytes, dtype):
  """head_next_token_loss(h, W) = next_token_loss(h·W): L, metrics, ∂L/∂h, ∂L/∂W (autodiff of the
  unfused loss), and the per-position hits; chunks of 2, 6 (5 does not divide the sequence) and 1 tokens."""
  rng = np.random.default_rng(2)
  hidden = jnp.asarray(rng.normal(size=(3, 6, 8)), dtype)
  kernel = jnp.asarray(rng.normal(size=(8, 13)), dtype)
  targets = jnp.asarray(rng.integers(0, 13, size=(3, 6)), jnp.int32)
  weights = jnp.asarray(rng.random((3, 6)) > 0.3, jnp.float32)
  logits = lambda h, w: jnp.einsum("bsd,dv->bsv", h, w, preferred_element_type=jnp.float32)
  unfused = lambda h, w: losses.next_token_loss(logits(h, w), targets, weights, z_loss=z_loss)
  head = lambda h, w: losses.head_next_token_loss(h, w, targets, weights, z_loss=z_loss, chunk_bytes=chunk_bytes)
  (want, want_metrics), want_grads = jax.value_and_grad(unfused, argnums=(0, 1), has_aux=True)(hidden, kernel)
  split = lambda loss, metrics, hits: (loss, (metrics, hits))
  (got, (got_metrics, hits)), got_grads = jax.value_and_grad(lambda h, w: split(*head(h, w)),
                                                             argnums=(0, 1), has_aux=True)(hidden, kernel)
  tol, atol = (1e-6, 1e-6) if dtype == jnp.float32 else (2e-2, 2e-3)      # gradients are ~0.1
  np.testing.assert_allclose(got, want, rtol=tol)
  for name in want_metrics:
    np.testing.assert_allclose(got_metrics[name], want_metrics[name], rtol=tol, err_msg=name)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=atol)
  np.testing.assert_array_equal(hits, losses.first_argmax(logits(hidden, kernel)) == targets)
  np.testing.assert_allclose(jax.jit(head)(hidden, kernel)[0], want, rtol=tol)      # the undifferentiated path
