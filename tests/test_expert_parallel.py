"""Expert parallelism on 8 CPU devices equals the single-device MoE layer; overflow is counted."""
import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k25jax.model import config, expert_parallel, moe
from k25jax.train import sharding

E, D, F, K = 8, 16, 12, 2
LAYER = dict(hidden_size=48, moe_intermediate_size=24, n_routed_experts=E, num_experts_per_tok=K,
             ep_capacity_factor=0.0)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
  """`jax.lax.ragged_all_to_all` as its docstring defines it, from a dense all_to_all
  (XLA:CPU has no ragged-all-to-all kernel)."""
  n, m = operand.shape[0], output.shape[0]
  rows = jnp.arange(n)
  blocks = jnp.where((rows[None] < send_sizes[:, None])[..., None],
                     operand[jnp.clip(input_offsets[:, None] + rows[None], 0, n - 1)], 0)
  received = jax.lax.all_to_all(blocks, axis_name, 0, 0)                         # [source, n, ...]
  offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)      # where each source writes
  dest = jnp.where(rows[None] < recv_sizes[:, None], offsets[:, None] + rows[None], m)
  padded = jnp.concatenate([output, jnp.zeros((1,) + output.shape[1:], output.dtype)])
  return padded.at[dest.reshape(-1)].set(received.reshape((-1,) + output.shape[1:]))[:m]


# ------------------------------------------------------------------ the MoE layer, router included
def moe_layer(router_bias=None, **overrides):
  cfg = config.preset("tiny", **{**LAYER, **overrides})
  layer = moe.MoE(cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (8, 6, cfg.hidden_size))
  params = nn.meta.unbox(layer.init(jax.random.PRNGKey(0), x))
  if router_bias is not None:
    params["params"]["gate"][moe.ROUTER_BIAS] = router_bias
  return layer, params, x


def value_and_grads(layer, params, x, mesh=None):
  """((Σ sin y, overflow), gradients wrt params and x), and the compiled program's HLO."""
  def loss(p, x):
    y, aux = layer.apply(p, x)
    return jnp.sum(jnp.sin(y)), aux["overflow"]

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  if mesh is None:
    return fn(params, x), ""
  with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    compiled = fn.lower(params, x).compile()
    return compiled(params, x), compiled.as_text()


LAYOUTS = {"data2-expert4": dict(data=2, expert=4), "fsdp2-expert2-tensor2": dict(fsdp=2, expert=2, tensor=2),
           "expert2-sequence2-tensor2": dict(expert=2, sequence=2, tensor=2)}


@functools.lru_cache(maxsize=None)
def single_device(routing):
  bias = jnp.zeros(E).at[5].set(100.0) if routing == "every_token_to_expert_5" else None
  layer, params, x = moe_layer(bias)
  return layer, params, x, value_and_grads(layer, params, x)[0]


@pytest.mark.parametrize("layout, routing", [
    ("data2-expert4", "learned"), ("fsdp2-expert2-tensor2", "every_token_to_expert_5"),
    ("expert2-sequence2-tensor2", "every_token_to_expert_5")])
def test_layer_equals_single_device(layout, routing):
  layer, params, x, ((ref, _), ref_grads) = single_device(routing)
  ((val, overflow), grads), hlo = value_and_grads(layer, params, x, sharding.make_mesh(LAYOUTS[layout]))
  assert int(overflow) == 0
  np.testing.assert_allclose(val, ref, rtol=1e-5)
  for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))
  if routing == "every_token_to_expert_5":   # the bias really sends every token there
    gate = params["params"]["gate"]
    _, experts, _ = moe.route(x.reshape(-1, x.shape[-1]) @ gate["kernel"], gate[moe.ROUTER_BIAS], top_k=K,
                              n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)
    assert bool(jnp.all(jnp.any(experts == 5, axis=-1)))
  if LAYOUTS[layout].get("fsdp", 1) > 1:
    # The detector below finds expert-weight gathers: with FSDP each device gathers the fsdp
    # shards of its own E/2 experts, [E/2, d, f], never the E experts of the layer.
    gathers = all_gathers_of_expert_weights(hlo)
    assert gathers and all(re.search(rf"\[{E // 2},", g) for g in gathers), gathers


# ------------------------------------------------------------------ the dispatch, routing given
def hand_routing(case, seed=0):
  """[8, 4, K] experts: 8 rows, one per device of a data=2 x expert=4 mesh."""
  rng = np.random.default_rng(seed)
  experts = np.stack([rng.choice(E, K, replace=False) for _ in range(32)]).reshape(8, 4, K)
  if case == "one_shard_to_one_expert":     # every token of the first shard: expert 3 (+ another)
    experts[0, :, 0] = 3
    experts[0, :, 1] = np.where(experts[0, :, 1] == 3, 4, experts[0, :, 1])
  return jnp.asarray(experts, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, (8, 4, K)), jnp.float32)


def dispatch(dispatch_mode, capacity_factor):
  return functools.partial(
      expert_parallel.routed_experts, token_spec=P(("data", "expert"), None, None),
      in_spec=P("expert", None, None), out_spec=P("expert", None, None), dispatch=dispatch_mode,
      capacity_factor=capacity_factor, ragged_all_to_all=emulated_ragged_all_to_all)


def tensors(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(8, 4, D)), jnp.float32)
  gate, up = (jnp.asarray(rng.normal(size=(E, D, F)) * 0.3, jnp.float32) for _ in range(2))
  return x, gate, up, jnp.asarray(rng.normal(size=(E, F, D)) * 0.3, jnp.float32)


def dense_reference(x, experts, weights, gate, up, down):
  flat = lambda a: a.reshape(-1, a.shape[-1])
  return moe.experts_dense(flat(x), flat(experts), flat(weights), gate, up, down).reshape(x.shape)


@pytest.mark.parametrize("mode, case", [("all_to_all", "random"), ("all_to_all", "one_shard_to_one_expert"),
                                        ("ragged_all_to_all", "one_shard_to_one_expert")])
def test_dispatch_equals_dense_values_and_gradients(mode, case):
  x, gate, up, down = tensors()
  experts, weights = hand_routing(case)
  ep = dispatch(mode, 0.0)
  loss = lambda fn: lambda x, w, g, u, d: jnp.sum(jnp.sin(fn(x, experts, w, g, u, d)))
  args = (x, weights, gate, up, down)
  ref, ref_grads = jax.value_and_grad(loss(dense_reference), argnums=range(5))(*args)
  with jax.set_mesh(sharding.make_mesh(dict(data=2, expert=4))):
    val, grads = jax.jit(jax.value_and_grad(loss(lambda *a: ep(*a)[0]), argnums=range(5)))(*args)
  np.testing.assert_allclose(val, ref, rtol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def kept_pairs(experts: np.ndarray, mode: str, capacity_factor: float) -> np.ndarray:
  """The drop rule, independently in NumPy: a device's pairs sorted by (expert, token, slot);
  all_to_all keeps the first C of each destination, ragged_all_to_all the rows that land below
  R in the destination's buffer, sources in order. experts: [8, 4, K] on data=2 x expert=4."""
  shards, local = 4, E // 4
  rows = expert_parallel.buffer_rows(4, K, shards, local, capacity_factor, mode)
  kept = np.zeros(experts.shape, bool)
  for group in range(2):
    filled = np.zeros(shards, int)                        # rows already in each destination's buffer
    for source in range(shards):
      row = group * shards + source
      flat = experts[row].reshape(-1)
      order = np.argsort(flat, kind="stable")
      rank = np.zeros(shards, int)
      for a in order:
        dest = flat[a] // local
        room = rank[dest] < rows if mode == "all_to_all" else filled[dest] + rank[dest] < rows
        kept[row].reshape(-1)[a] = room
        rank[dest] += 1
      filled += np.bincount(flat // local, minlength=shards)
  return kept


@pytest.mark.parametrize("mode", ["all_to_all", "ragged_all_to_all"])
def test_overflow_counted_and_dropped_pairs_contribute_nothing(mode):
  x, gate, up, down = tensors(1)
  experts, weights = hand_routing("one_shard_to_one_expert", seed=1)
  kept = kept_pairs(np.asarray(experts), mode, 0.5)
  with jax.set_mesh(sharding.make_mesh(dict(data=2, expert=4))):
    y, overflow = jax.jit(dispatch(mode, 0.5))(x, experts, weights, gate, up, down)
  assert int(overflow) == int((~kept).sum()) > 0
  expected = dense_reference(x, experts, weights * jnp.asarray(kept, jnp.float32), gate, up, down)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_buffer_rows():
  # all_to_all: slots of c·A/P rows, at most T·min(k, E_loc); ragged: c·A, at most P·T·min(k, E_loc).
  assert expert_parallel.buffer_rows(16, 2, 4, 2, 1.0, "all_to_all") == 8
  assert expert_parallel.buffer_rows(16, 2, 4, 2, 0.0, "all_to_all") == 32
  assert expert_parallel.buffer_rows(16, 2, 4, 2, 1.25, "ragged_all_to_all") == 40
  assert expert_parallel.buffer_rows(16, 2, 4, 2, 0.0, "ragged_all_to_all") == 128
  assert expert_parallel.buffer_rows(16, 8, 4, 2, 100.0, "ragged_all_to_all") == 128


def test_batch_that_does_not_divide_over_the_devices_is_an_error():
  x, gate, up, down = tensors()
  experts, weights = hand_routing("random")
  with jax.set_mesh(sharding.make_mesh(dict(data=2, expert=4))), pytest.raises(ValueError, match="must divide"):
    dispatch("all_to_all", 0.0)(x[:6], experts[:6], weights[:6], gate, up, down)


# ------------------------------------------------------------------ the compiled program
def all_gathers_of_expert_weights(hlo: str) -> list[str]:
  """All-gathers whose result is a 3-D+ [.., d, f/t] or [.., f/t, d] tensor (the expert
  weights' shape, f split t = 1, 2 or 4 ways by tensor parallelism)."""
  d, f = LAYER["hidden_size"], LAYER["moe_intermediate_size"]
  shapes = {pair for t in (1, 2, 4) for pair in ((d, f // t), (f // t, d))}
  found = []
  for line in hlo.splitlines():
    m = re.search(r"= \w+\[([\d,]+)\]\{[^}]*\} all-gather(?:-start)?\(", line)
    if m:
      dims = tuple(int(v) for v in m.group(1).split(","))
      if len(dims) >= 3 and dims[-2:] in shapes:
        found.append(line.strip())
  return found


@pytest.mark.slow
def test_ep_train_step_has_all_to_all_and_no_all_gather_of_expert_weights():
  from test_train_step import micro_config
  from k25jax.model import transformer
  from k25jax.stages import pretrain
  from configs import common
  from k25jax.train import config_utils, optimizer, trainer as trainer_lib
  cfg = micro_config()
  cfg.model = common.model_section("tiny", **{
      **dataclasses.asdict(config_utils.model_config_from(cfg.model)), **LAYER, "n_shared_experts": 0})
  model = transformer.Transformer(config_utils.model_config_from(cfg.model))
  tx = optimizer.make_optimizer(cfg.optimizer, cfg.train.steps)
  mesh = sharding.make_mesh(dict(data=2, expert=4))
  with jax.set_mesh(mesh):
    state = trainer_lib.state_target(model, tx, mesh)
    batch = {k: jax.ShapeDtypeStruct((8, 16), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=sharding.batch_sharding(mesh))
             for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
    hlo = pretrain.make_step(cfg, model, tx).lower(state, batch).compile().as_text()
  assert len(re.findall(r" all-to-all\(", hlo)) >= 4          # dispatch and return, forward and backward
  assert all_gathers_of_expert_weights(hlo) == []



def test_a_large_moe_without_an_expert_axis_is_refused_up_front():
  """k25's 384 experts are 33.8 GB a layer in bf16: gathered on every chip of a 95 GB pod without
  an expert axis (XLA's TPU compiler also fails on that layout's global expert counts)."""
  k25 = config.preset("k25")
  with jax.set_mesh(sharding.make_mesh(dict(fsdp=-1))):
    with pytest.raises(ValueError, match=r"all 384 routed experts.*33\.8 GB.*mesh\.expert"):
      expert_parallel.check_layout(k25, 95e9)
    expert_parallel.check_layout(k25, None)                       # memory unknown (a CPU): not checked
    expert_parallel.check_layout(config.preset("tiny"), 95e9)     # 0.8 MB of experts a layer
  with jax.set_mesh(sharding.make_mesh(dict(fsdp=2, expert=4))):
    expert_parallel.check_layout(k25, 95e9)                       # split over `expert`
