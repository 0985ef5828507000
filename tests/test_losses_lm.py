"""k25jax.losses.next_token_loss against a NumPy reference."""
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
