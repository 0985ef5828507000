"""MuonClip on the 8-device CPU mesh (params and moments sharded) equals the one-device step."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from k25jax.model import config, transformer
from k25jax.optim import muonclip, partition
from k25jax.train import sharding

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2,
             q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
TAU, STEPS = 10.0, 3


def inputs(cfg):
  """Params (norms 1, the rest N(0, 0.02²)), a gradient per step and max logits around tau."""
  rng = np.random.default_rng(0)
  shapes = nn.meta.unbox(transformer.abstract_params(cfg))
  normal = lambda s, std: np.asarray(std * rng.normal(size=s.shape), np.float32)
  params = jax.tree_util.tree_map_with_path(
      lambda path, s: np.ones(s.shape, np.float32) if partition.names(path)[-1] == "weight" else normal(s, 0.02),
      shapes)
  grads = [jax.tree.map(lambda s: normal(s, 1.0), shapes) for _ in range(STEPS)]
  max_logits = [np.asarray(rng.uniform(5, 20, (cfg.num_hidden_layers, cfg.num_attention_heads)), np.float32)
                for _ in range(STEPS)]
  return params, grads, max_logits


def run(cfg, tx, params, grads, max_logits, mesh=None):
  """STEPS of update → apply → qk_clip, one jit; sharded over `mesh` when given."""

  def step(params, opt_state, grads, max_logits):
    updates, opt_state = tx.update(grads, opt_state, params)
    params, metrics = muonclip.qk_clip(optax.apply_updates(params, updates), max_logits, TAU)
    return params, opt_state, metrics

  if mesh is None:
    step_fn, put = jax.jit(step), lambda tree, _: jax.tree.map(jnp.asarray, tree)
    opt_state = tx.init(put(params, None))
  else:
    boxed = transformer.abstract_params(cfg)
    p_sh = sharding.logical_to_sharding(boxed, mesh)
    o_sh = sharding.logical_to_sharding(jax.eval_shape(tx.init, boxed), mesh)
    rep = sharding.replicated(mesh)
    step_fn = jax.jit(step, in_shardings=(p_sh, o_sh, p_sh, rep), out_shardings=(p_sh, o_sh, rep))
    put = jax.device_put
    params = put(params, p_sh)
    opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
  clipped = []
  for g, m in zip(grads, max_logits):
    params, opt_state, metrics = step_fn(params, opt_state, put(g, p_sh if mesh else None),
                                         put(m, rep if mesh else None))
    clipped.append(int(metrics["clipped_heads"]))
  return params, opt_state, clipped


def test_eight_devices_match_one():
  cfg = config.preset("tiny", **SMALL)
  tx = muonclip.muonclip(0.05, weight_decay=0.1)
  params, grads, max_logits = inputs(cfg)
  ref_params, _, ref_clipped = run(cfg, tx, params, grads, max_logits)
  mesh = sharding.make_mesh(dict(fsdp=2, expert=2, tensor=2))
  with jax.set_mesh(mesh):
    got_params, got_state, got_clipped = run(cfg, tx, params, grads, max_logits, mesh)
  assert got_clipped == ref_clipped and min(got_clipped) > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
               got_params, ref_params)
  # The Muon matrices and their momenta were really split across the 8 devices.
  experts = got_params["layers_1"]["mlp"]["experts"]["gate_proj"]            # [E=4, d=64, f=32]
  assert experts.sharding.spec == P("expert", ("fsdp", "sequence"), "tensor")
  assert experts.addressable_shards[0].data.shape == (2, 32, 16)
  q_b = got_params["layers_1"]["self_attn"]["q_b_proj"]["kernel"]           # [q_lora, H, nope + rope]
  assert q_b.addressable_shards[0].data.shape == (16, 2, 24)
  moments = [x for x in jax.tree.leaves(got_state) if x.shape == experts.shape]
  assert len(moments) == 2 and all(m.sharding.is_equivalent_to(experts.sharding, 3) for m in moments)
