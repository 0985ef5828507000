"""Muon against an independent NumPy (float64) implementation of the published algorithm."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k25jax.optim import muonclip

LR, WD, MU, STEPS = 0.02, 0.1, 0.95, 4


def ns_reference(g):
  """Moonlight's zeropower_via_newtonschulz5, in float64."""
  a, b, c = 3.4445, -4.7750, 2.0315
  x = g.T if g.shape[0] > g.shape[1] else g
  x = x / (np.linalg.norm(x) + 1e-7)
  for _ in range(5):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if g.shape[0] > g.shape[1] else x


def muon_reference(w, grads):
  """buf = μ buf + g; n = g + μ buf; w ← w − lr (0.2 sqrt(max(A, B)) NS(n) + wd w)."""
  buf = np.zeros_like(w)
  for g in grads:
    buf = MU * buf + g
    n = g + MU * buf
    w = w - LR * (0.2 * np.sqrt(max(w.shape)) * ns_reference(n) + WD * w)
  return w


def run_ours(name, w, grads):
  """STEPS updates of muonclip on {name: w}; `name` is the param path the partition reads."""
  params = {}
  node = params
  for key in name[:-1]:
    node = node.setdefault(key, {})
  node[name[-1]] = jnp.asarray(w, jnp.float32)
  tx = muonclip.muonclip(LR, weight_decay=WD, momentum=MU)
  state = tx.init(params)
  leaf = lambda tree: jax.tree.leaves(tree)[0]
  for g in grads:
    g_tree = jax.tree.map(lambda _: jnp.asarray(g, jnp.float32), params)
    updates, state = tx.update(g_tree, state, params)
    params = optax.apply_updates(params, updates)
  return np.asarray(leaf(params), np.float64)


# (param path, shape, how the reference sees it as matrices: a function to [batch, rows, cols]
#  and its inverse)
LAYOUTS = {
    "wide 2-D kernel": (("layers_0", "mlp", "gate_proj", "kernel"), (24, 40),
                        lambda w: w[None], lambda m: m[0]),
    "tall 2-D kernel": (("layers_0", "mlp", "down_proj", "kernel"), (40, 24),
                        lambda w: w[None], lambda m: m[0]),
    "stacked experts": (("layers_1", "mlp", "experts", "up_proj"), (3, 16, 24),
                        lambda w: w, lambda m: m),
    "q_b_proj [in, H, c]": (("layers_0", "self_attn", "q_b_proj", "kernel"), (20, 3, 12),
                            lambda w: w.reshape(1, 20, 36), lambda m: m.reshape(20, 3, 12)),
    "o_proj [H, v, d]": (("layers_0", "self_attn", "o_proj", "kernel"), (3, 8, 20),
                         lambda w: w.reshape(1, 24, 20), lambda m: m.reshape(3, 8, 20)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_matches_numpy_reference(layout):
  name, shape, to_matrices, from_matrices = LAYOUTS[layout]
  rng = np.random.default_rng(0)
  w = rng.normal(size=shape) * 0.1
  grads = [rng.normal(size=shape) for _ in range(STEPS)]
  expected = from_matrices(np.stack([muon_reference(m, [to_matrices(g)[i] for g in grads])
                                     for i, m in enumerate(to_matrices(w))]))
  got = run_ours(name, w, grads)
  # Compare the parameter change: a relative error of the update, not of w.
  np.testing.assert_allclose(got - w, expected - w, rtol=0, atol=1e-5 * np.abs(expected - w).max())


def test_experts_are_orthogonalised_one_by_one():
  """Scaling one expert's gradient must not change the other experts' updates."""
  rng = np.random.default_rng(1)
  w = rng.normal(size=(3, 16, 24)) * 0.1
  g = rng.normal(size=(3, 16, 24))
  name = ("layers_1", "mlp", "experts", "gate_proj")
  base = run_ours(name, w, [g])
  g_scaled = g.copy()
  g_scaled[0] *= 1000.0
  scaled = run_ours(name, w, [g_scaled])
  np.testing.assert_allclose(scaled[1:], base[1:], rtol=1e-6)
  # Orthogonalised updates have singular values near 1 in every expert, RMS ≈ 0.2·lr·…
  rms = np.sqrt(np.mean((base - w * (1 - LR * WD)) ** 2, axis=(1, 2)))
  np.testing.assert_allclose(rms, rms.mean(), rtol=0.1)
