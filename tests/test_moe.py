"""MoE: the expert paths agree (values and gradients) on edge cases; router helpers by hand."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k25jax.model import config, moe
from k25jax.ops import moe as moe_ops

E, D, F = 8, 16, 12


def _weights(seed=0):
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
  return (jax.random.normal(k1, (24, D)), jax.random.normal(k2, (E, D, F)) * 0.3,
          jax.random.normal(k3, (E, D, F)) * 0.3, jax.random.normal(k4, (E, F, D)) * 0.3)


def _routing(case, n_tokens=24, top_k=2, seed=0):
  rng = np.random.default_rng(seed)
  if case == "random":
    experts = np.stack([rng.choice(E, top_k, replace=False) for _ in range(n_tokens)])
  elif case == "one_expert_takes_all":      # top-1 routing, every token to expert 5
    experts = np.full((n_tokens, 1), 5)
  elif case == "empty_experts":             # experts 0, 2, 3, 6 receive nothing
    experts = np.stack([rng.choice([1, 4, 5, 7], top_k, replace=False) for _ in range(n_tokens)])
  weights = rng.uniform(0.1, 1.0, size=experts.shape)
  return jnp.asarray(experts, jnp.int32), jnp.asarray(weights, jnp.float32)


PATHS = {
    "ragged_or_dense": moe_ops.experts_ragged_or_dense,
    "ragged_block4": lambda *a: moe_ops.experts_ragged(*a, block=4),
    "ragged_block1": lambda *a: moe_ops.experts_ragged(*a, block=1),
    "ragged_auto": moe_ops.experts_ragged,
    "ragged_dot": moe_ops.experts_ragged_dot,
}


@pytest.mark.parametrize("case", ["random", "one_expert_takes_all", "empty_experts"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_paths_equal_dense_values_and_gradients(case, path):
  x, gate, up, down = _weights()
  experts, weights = _routing(case)

  def loss(fn):
    return lambda x, w, g, u, d: jnp.sum(jnp.sin(fn(x, experts, w, g, u, d)))

  args = (x, weights, gate, up, down)
  ref_val, ref_grads = jax.value_and_grad(loss(moe_ops.experts_dense), argnums=range(5))(*args)
  val, grads = jax.value_and_grad(loss(PATHS[path]), argnums=range(5))(*args)
  np.testing.assert_allclose(val, ref_val, rtol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
  if case == "empty_experts":
    assert not np.any(grads[2][np.array([0, 2, 3, 6])])  # unrouted experts get no gradient


@pytest.mark.parametrize("top_k", [1, 3])
def test_take_rows_gradient_is_the_gather_transposed(top_k):
  """take_rows' written-out transpose (a gather through the tile layout's slots) equals
  autodiff of the plain gather, padding slots (index N) reading zeros; both directions."""
  groups = jnp.asarray(np.random.default_rng(3).integers(0, E, size=7 * top_k), jnp.int32)
  source, slot, _ = moe_ops.tile_layout(groups, E, 4)
  x = jax.random.normal(jax.random.PRNGKey(1), (7, D))
  token = jnp.where(source < 7 * top_k, source // top_k, 7)
  plain = lambda x: jnp.concatenate([x, jnp.zeros((1, D))])[token]
  cot = jax.random.normal(jax.random.PRNGKey(2), (source.shape[0], D))
  rows, vjp = jax.vjp(lambda x: moe_ops.take_rows(x, token, slot, top_k), x)
  want_rows, want_vjp = jax.vjp(plain, x)
  np.testing.assert_array_equal(rows, want_rows)
  np.testing.assert_allclose(vjp(cot)[0], want_vjp(cot)[0], rtol=1e-6, atol=1e-6)
  y_rows = jax.random.normal(jax.random.PRNGKey(3), (source.shape[0], D))            # and back: slot → source
  back, back_vjp = jax.vjp(lambda y: moe_ops.take_rows(y, slot, source, 1), y_rows)
  np.testing.assert_array_equal(back, y_rows[slot])
  cot_back = jax.random.normal(jax.random.PRNGKey(4), back.shape)
  np.testing.assert_allclose(back_vjp(cot_back)[0], jax.vjp(lambda y: y[slot], y_rows)[1](cot_back)[0], rtol=1e-6)


def test_tiles_only_where_they_move_less_than_dense():
  """The roofline count of `tiles_cost_more_than_dense`, in units of one expert's weights:
  tiles 2·100·n_tiles + 2·n_rows against dense 100·E + 2·T·E."""
  assert moe_ops.tiles_cost_more_than_dense(8, 4, 16, block=1)           # decode: 6464 > 1856
  assert not moe_ops.tiles_cost_more_than_dense(4096, 4, 16, block=128)  # training: 65.7K < 132.7K
  assert not moe_ops.tiles_cost_more_than_dense(1, 8, 384, block=1)      # one token, many experts
  assert moe_ops.tiles_cost_more_than_dense(64, 8, 384, block=1)


def test_route_selects_on_biased_but_weights_unbiased():
  logits = jnp.array([[0.0, 1.0, 2.0, -1.0]])
  bias = jnp.array([5.0, 0.0, 0.0, 0.0])            # pushes expert 0 into the top-2
  w, experts, s = moe_ops.route(logits, bias, top_k=2, n_group=1, topk_group=1, norm_topk_prob=True,
                            routed_scaling_factor=2.0)
  assert sorted(np.asarray(experts[0]).tolist()) == [0, 2]
  sig = 1 / (1 + np.exp(-np.array([0.0, 2.0])))
  expected = 2.0 * sig / sig.sum()
  order = np.argsort(np.asarray(experts[0]))
  np.testing.assert_allclose(np.asarray(w[0])[order], expected, rtol=1e-6)


def test_group_limited_routing_only_uses_kept_groups():
  # 4 groups of 2; group scores (sum of top-2) are highest for groups 1 and 3.
  logits = jnp.array([[0.1, 0.0, 3.0, 2.9, 0.2, 0.1, 2.0, 2.5]])
  _, experts, _ = moe_ops.route(logits, jnp.zeros(8), top_k=3, n_group=4, topk_group=2,
                            norm_topk_prob=True, routed_scaling_factor=1.0)
  assert set(np.asarray(experts[0]).tolist()) <= {2, 3, 6, 7}
  assert set(np.asarray(experts[0]).tolist()) == {2, 3, 7}


def test_bias_update_moves_toward_balance():
  bias = jnp.zeros((2, 4))
  load = jnp.array([[10.0, 2.0, 4.0, 4.0], [5.0, 5.0, 5.0, 5.0]])
  new = moe.update_router_bias(bias, load, gamma=1e-3)
  np.testing.assert_allclose(new, [[-1e-3, 1e-3, 1e-3, 1e-3], [0, 0, 0, 0]], atol=1e-9)


def test_sequence_balance_loss_by_hand():
  # One sequence, 2 tokens, 2 experts, top-1: token 0 → expert 0, token 1 → expert 0.
  scores = jnp.array([[[0.6, 0.2], [0.5, 0.5]]])
  experts = jnp.array([[[0], [0]]])
  loss = moe.sequence_balance_loss(scores, experts, jnp.ones((1, 2), bool))
  f = np.array([2 * 2 / (1 * 2), 0.0])                   # E/(k T) * hits
  p = np.array([(0.75 + 0.5) / 2, (0.25 + 0.5) / 2])     # mean normalised scores
  np.testing.assert_allclose(loss, np.sum(f * p), rtol=1e-6)


def test_expert_load_excludes_padding():
  experts = jnp.array([[0, 1], [1, 2], [3, 0]])
  load = moe.expert_load(experts, 4, jnp.array([True, True, False]))
  np.testing.assert_array_equal(load, [1, 2, 1, 0])


@pytest.mark.parametrize("n_experts, top_k", [(16, 4), (384, 8)])
def test_ragged_compiled_flops_pay_only_for_routed_tokens(n_experts, top_k):
  cfg = config.preset("tiny", n_routed_experts=n_experts, num_experts_per_tok=top_k, n_shared_experts=0)
  layer = moe.MoE(cfg)
  x = jax.ShapeDtypeStruct((2, 1024, cfg.hidden_size), jnp.float32)
  variables = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)
  flops = jax.jit(lambda v, x: layer.apply(v, x)[0]).lower(variables, x).compile().cost_analysis()["flops"]
  tokens, d, f = 2048, cfg.hidden_size, cfg.moe_intermediate_size
  analytic = tokens * (top_k * 6 * d * f + 2 * d * n_experts)
  assert flops <= 1.3 * analytic, flops / analytic
