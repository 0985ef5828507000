"""Pallas MoE kernels (interpreted) against XLA: routing + sort, gmm / tgmm, the expert layer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k25jax.ops import moe as ops_moe
from pallas_kernels import moe


def _close(actual, expected, rtol):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * max(np.abs(expected).max(), 1e-30))


# ------------------------------------------------------------------------------ routing
ROUTES = {   # (tokens, experts, routing kwargs, block, formulation)
    "group_limited": (50, 16, dict(top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.827), 16, "tpu"),
    "gpu_k3_unnormalised": (37, 12, dict(top_k=3, norm_topk_prob=False, routed_scaling_factor=1.5), 16, "gpu"),
}


@pytest.mark.parametrize("case", sorted(ROUTES))
def test_route_equals_xla(case):
  n_tokens, n_experts, kw, block, formulation = ROUTES[case]
  rng = np.random.default_rng(n_tokens)
  logits = jnp.asarray(rng.normal(size=(n_tokens, n_experts)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(n_experts,)) * 0.3, jnp.float32)   # changes the selection
  kernel = lambda z: moe.route(z, bias, block_tokens=block, formulation=formulation, **kw)
  reference = lambda z: moe.reference_route(z, bias, **kw)
  got, want = kernel(logits), reference(logits)
  for name in ("experts", "group_sizes", "order", "position"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
  _close(got.weights, want.weights, 1e-6)
  _close(got.scores, want.scores, 1e-6)

  def loss(fn):
    return lambda z: jnp.sum(jnp.sin(3.0 * fn(z).weights)) + jnp.sum(fn(z).scores ** 2)

  _close(jax.grad(loss(kernel))(logits), jax.grad(loss(reference))(logits), 1e-5)


@pytest.mark.parametrize("case", ["one_expert_takes_all", "empty_experts"])
def test_sort_by_expert_equals_stable_argsort(case):
  rng = np.random.default_rng(1)
  if case == "one_expert_takes_all":
    experts = np.full((40, 1), 5)
  else:                       # experts 0, 2, 3, 6 receive nothing
    experts = np.stack([rng.choice([1, 4, 5, 7], 2, replace=False) for _ in range(40)])
  experts = jnp.asarray(experts, jnp.int32)
  group_sizes, order, position = moe.sort_by_expert(experts, 8, block_tokens=16)
  want_order, want_sizes = ops_moe.sort_by_expert(experts, 8)
  np.testing.assert_array_equal(group_sizes, want_sizes)
  np.testing.assert_array_equal(order, want_order)
  np.testing.assert_array_equal(position[order], np.arange(order.shape[0]))


# ------------------------------------------------------------------------------ grouped matmul
GROUPS = {   # (group_sizes over E = 6, group_offset, local experts, formulation)
    "ragged_with_empty": ([10, 0, 17, 3, 0, 12], 0, 6, "tpu"),
    "one_group_takes_all": ([0, 0, 45, 0, 0, 0], 0, 6, "tpu"),
    "all_empty": ([0] * 6, 0, 6, "tpu"),
    "shard_offset_2": ([10, 0, 17, 3, 0, 12], 2, 3, "tpu"),
    "gpu_ragged_with_empty": ([10, 0, 17, 3, 0, 12], 0, 6, "gpu"),
    "gpu_shard_offset_3": ([8, 8, 8, 8, 8, 10], 3, 2, "gpu"),
}
M, K, N = 50, 32, 24          # 50 rows: not a multiple of the 16-row tile; 8 rows past the groups


@pytest.mark.parametrize("case", sorted(GROUPS))
def test_gmm_equals_xla_values_and_gradients(case):
  sizes, offset, num_local, formulation = GROUPS[case]
  group_sizes = jnp.asarray(sizes, jnp.int32)
  rng = np.random.default_rng(len(case))
  lhs = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(num_local, K, N)), jnp.float32)
  kernel = lambda x, w: moe.gmm(x, w, group_sizes, offset, tiling=(16, 16, 8), formulation=formulation)
  reference = lambda x, w: moe.reference_gmm(x, w, group_sizes, offset)
  _close(kernel(lhs, rhs), reference(lhs, rhs), 1e-5)
  loss = lambda fn: lambda x, w: jnp.sum(jnp.sin(fn(x, w)))
  grads = jax.grad(loss(kernel), argnums=(0, 1))(lhs, rhs)
  ref_grads = jax.grad(loss(reference), argnums=(0, 1))(lhs, rhs)
  for g, r in zip(grads, ref_grads):
    _close(g, r, 1e-5)
  if case == "shard_offset_2":   # rows of groups 0-1 and 5 belong to other shards
    assert not np.any(np.asarray(kernel(lhs, rhs))[:10]) and not np.any(np.asarray(grads[0])[30:])


@pytest.mark.parametrize("formulation", ["tpu", "gpu"])
def test_gmm_transposed_rhs_and_bf16(formulation):
  group_sizes = jnp.asarray([7, 0, 20, 13], jnp.int32)
  rng = np.random.default_rng(2)
  lhs = jnp.asarray(rng.normal(size=(40, K)), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=(4, N, K)), jnp.bfloat16)
  kernel = lambda x, w: moe.gmm(x, w, group_sizes, transpose_rhs=True, tiling=(16, 16, 8), formulation=formulation)
  reference = lambda x, w: moe.reference_gmm(x, w, group_sizes, transpose_rhs=True)
  _close(kernel(lhs, rhs), reference(lhs, rhs), 1e-2)
  loss = lambda fn: lambda x, w: jnp.sum(jnp.sin(fn(x, w).astype(jnp.float32)))
  for g, r in zip(jax.grad(loss(kernel), argnums=(0, 1))(lhs, rhs), jax.grad(loss(reference), argnums=(0, 1))(lhs, rhs)):
    _close(g, r, 2e-2)


def test_tgmm_empty_group_is_zero():
  group_sizes = jnp.asarray([5, 0, 30, 0], jnp.int32)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(40, 16)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(40, 8)), jnp.float32)
  out = moe.tgmm(x, y, group_sizes, 4, tiling=(16, 8, 8))
  _close(out, moe.reference_tgmm(x, y, group_sizes, 0, 4), 1e-5)
  assert not np.any(np.asarray(out)[[1, 3]])


# ------------------------------------------------------------------------------ the expert layer
def test_routed_experts_equal_dense_values_and_gradients():
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
  x = jax.random.normal(k1, (24, 16))
  gate, up = (jax.random.normal(k, (8, 16, 12)) * 0.3 for k in (k2, k3))
  down = jax.random.normal(k4, (8, 12, 16)) * 0.3
  rng = np.random.default_rng(0)
  experts = jnp.asarray(np.stack([rng.choice([1, 4, 5, 7], 2, replace=False) for _ in range(24)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(24, 2)), jnp.float32)

  def loss(fn):
    return lambda *a: jnp.sum(jnp.sin(fn(a[0], experts, *a[1:])))

  args = (x, weights, gate, up, down)
  val, grads = jax.value_and_grad(loss(lambda *a: moe.routed_experts(*a, tiling=(16, 16, 16))),
                                  argnums=range(5))(*args)
  ref_val, ref_grads = jax.value_and_grad(loss(ops_moe.experts_dense), argnums=range(5))(*args)
  _close(val, ref_val, 1e-5)
  for g, r in zip(grads, ref_grads):
    _close(g, r, 1e-5)
