"""Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable"; Kimi K2, Algorithm 1).

For a weight W ∈ R^{n×m} with gradient G_t, learning rate η_t and weight decay λ:

    M_t = μ M_{t−1} + G_t                               (momentum, μ = 0.95)
    N_t = G_t + μ M_t                                   (Nesterov; N_t = M_t without it)
    O_t = NS(N_t) · 0.2 · sqrt(max(n, m))               (RMS of O_t ≈ AdamW's update RMS)
    W_t = W_{t−1} − η_t (O_t + λ W_{t−1})               (decoupled weight decay)

NS is 5 steps of the quintic Newton–Schulz iteration towards U Vᵀ (G = U S Vᵀ):

    X_0 = N / (‖N‖_F + ε),   A = X_k X_kᵀ,   X_{k+1} = a X_k + (b A + c A²) X_k,
    (a, b, c) = (3.4445, −4.7750, 2.0315),

run on the transpose when n > m so that A is the smaller Gram matrix. A tensor that
is a batch of matrices (stacked experts) is orthogonalised matrix by matrix; which
axes are rows and columns comes from `k25jax.optim.partition.matrix_axes`. The layers of a
scanned stack (`moe_layers`) are orthogonalised one after the other (`lax.map`).

`optax.contrib.muon` is not used as a whole: its Nesterov momentum is a bias-corrected
moving average (a different direction during the first ~100 steps) and its default
routing sends the 3-D MLA and expert kernels to Adam.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from k25jax.optim.partition import MatrixAxes, matrix_axes, stacked_axes

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(x: jax.Array, *, steps: int = 5, coeffs=NS_COEFFS, eps: float = 1e-7) -> jax.Array:
  """NS(x) for one matrix x [n, m] (the iteration of the module docstring), its steps a
  `fori_loop`: one compiled body instead of `steps` copies of it (the Muon update of a small
  K2.5 train step compiled in 3 s less)."""
  a, b, c = coeffs
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  x = x / (jnp.linalg.norm(x) + eps)

  def iteration(_, x):
    gram = x @ x.T
    return a * x + (b * gram + c * gram @ gram) @ x

  x = jax.lax.fori_loop(0, steps, iteration, x)
  return x.T if tall else x


def orthogonalize(x: jax.Array, axes: MatrixAxes, *, steps: int, coeffs, eps: float,
                  rms_scale: float) -> jax.Array:
  """NS(·) · rms_scale · sqrt(max(rows, cols)) of each matrix of x (rows = Π x.shape[axes.rows])."""
  order = axes.batch + axes.rows + axes.cols
  sizes = [math.prod(x.shape[a] for a in group) for group in (axes.batch, axes.rows, axes.cols)]
  matrices = jnp.transpose(x, order).reshape(sizes)
  ortho = jax.vmap(lambda m: newton_schulz(m, steps=steps, coeffs=coeffs, eps=eps))(matrices)
  ortho = ortho * (rms_scale * math.sqrt(max(sizes[1], sizes[2])))
  inverse = tuple(sorted(range(x.ndim), key=order.__getitem__))
  return jnp.transpose(ortho.reshape([x.shape[a] for a in order]), inverse)


def scale_by_orthogonalization(*, steps: int = 5, coeffs=NS_COEFFS, eps: float = 1e-7,
                               rms_scale: float = 0.2) -> optax.GradientTransformation:
  """Stateless: replaces each update N by `orthogonalize(N)` (O_t of the module docstring)."""

  def ortho(path, u):
    axes = matrix_axes(path, u.shape)
    run = lambda x, axes: orthogonalize(x, axes, steps=steps, coeffs=coeffs, eps=eps, rms_scale=rms_scale)
    if not stacked_axes(path):
      return run(u, axes)
    # A scanned layer stack, one layer at a time: the temporaries stay one layer's size.
    down = lambda group: tuple(a - 1 for a in group)
    layer = MatrixAxes(down(axes.batch[1:]), down(axes.rows), down(axes.cols))
    return jax.lax.map(lambda x: run(x, layer), u)

  def update_fn(updates, state, params=None):
    del params
    return jax.tree_util.tree_map_with_path(ortho, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def muon(learning_rate: optax.ScalarOrSchedule, *, momentum: float = 0.95, nesterov: bool = True,
         ns_steps: int = 5, ns_coeffs=NS_COEFFS, eps: float = 1e-7, rms_scale: float = 0.2,
         weight_decay: float = 0.0) -> optax.GradientTransformation:
  """Muon for the matrices it is given: u_t = −η_t (O_t + λ W_{t−1})."""
  return optax.chain(
      optax.trace(decay=momentum, nesterov=nesterov),
      scale_by_orthogonalization(steps=ns_steps, coeffs=ns_coeffs, eps=eps, rms_scale=rms_scale),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
  )
