"""Which parameters of the tiny model get Muon, AdamW, or no update at all."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k25jax.model import config, transformer
from k25jax.optim import muonclip, partition
from k25jax.optim.partition import ADAMW, FROZEN, MUON

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2,
             q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def table(params) -> dict[str, str]:
  flat = jax.tree_util.tree_flatten_with_path(partition.labels(params))[0]
  return {"/".join(partition.names(path)): label for path, label in flat}


def expected_table(cfg) -> dict[str, str]:
  q = ({"q_a_proj/kernel": MUON, "q_a_layernorm/weight": ADAMW, "q_b_proj/kernel": MUON}
       if cfg.q_lora_rank else {"q_proj/kernel": MUON})
  attn = dict(q, **{"kv_a_proj_with_mqa/kernel": MUON, "kv_a_layernorm/weight": ADAMW,
                    "kv_b_proj/kernel": MUON, "o_proj/kernel": MUON})
  if cfg.attention_bias:
    attn.update({"kv_a_proj_with_mqa/bias": ADAMW, "o_proj/bias": ADAMW})
    if cfg.q_lora_rank:
      attn["q_a_proj/bias"] = ADAMW
  dense = {f"mlp/{p}/kernel": MUON for p in ("gate_proj", "up_proj", "down_proj")}
  moe = {"mlp/gate/kernel": ADAMW, "mlp/gate/e_score_correction_bias": FROZEN,
         **{f"mlp/experts/{p}": MUON for p in ("gate_proj", "up_proj", "down_proj")},
         **{f"mlp/shared_experts/{p}/kernel": MUON for p in ("gate_proj", "up_proj", "down_proj")}}
  out = {"embed_tokens/embedding": ADAMW, "lm_head": ADAMW, "norm/weight": ADAMW}
  for i in range(cfg.num_hidden_layers):
    layer = {"input_layernorm/weight": ADAMW, "post_attention_layernorm/weight": ADAMW,
             **{f"self_attn/{k}": v for k, v in attn.items()},
             **(moe if cfg.is_moe_layer(i) else dense)}
    out.update({f"layers_{i}/{k}": v for k, v in layer.items()})
  return out


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None, "attention_bias": True}],
                         ids=["tiny", "no_q_lora+bias"])
def test_partition_of_the_tiny_model(overrides):
  cfg = config.preset("tiny", **overrides)
  assert table(transformer.abstract_params(cfg)) == expected_table(cfg)


def test_muon_matrix_shapes_of_the_tiny_model():
  """rows × cols (and batch) of every Muon matrix: the checkpoint's nn.Linear, one per expert."""
  cfg = config.preset("tiny")
  shapes = {}
  for path, x in jax.tree_util.tree_flatten_with_path(transformer.abstract_params(cfg))[0]:
    if partition.label(path, x) == MUON:
      axes = partition.matrix_axes(path, x.shape)
      size = lambda group: math.prod(x.shape[a] for a in group)
      shapes["/".join(partition.names(path))] = (size(axes.batch), size(axes.rows), size(axes.cols))
  d, h, e = cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts
  assert shapes["layers_1/self_attn/q_b_proj/kernel"] == (1, cfg.q_lora_rank, h * cfg.qk_head_dim)
  assert shapes["layers_1/self_attn/kv_b_proj/kernel"] == (
      1, cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
  assert shapes["layers_1/self_attn/o_proj/kernel"] == (1, h * cfg.v_head_dim, d)
  assert shapes["layers_1/mlp/experts/gate_proj"] == (e, d, cfg.moe_intermediate_size)
  assert shapes["layers_1/mlp/experts/down_proj"] == (e, cfg.moe_intermediate_size, d)
  assert shapes["layers_0/mlp/down_proj/kernel"] == (1, cfg.intermediate_size, d)


def test_router_bias_gets_no_update_and_norms_no_decay():
  """With zero gradients only weight decay moves params: matrices shrink by lr·wd, norms and
  the router bias stay; with a gradient on the router bias it still does not move."""
  cfg = config.preset("tiny", **SMALL)
  shapes = nn.meta.unbox(transformer.abstract_params(cfg))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), jnp.float32), shapes)
  lr, wd = 0.1, 0.5
  tx = muonclip.muonclip(lr, weight_decay=wd)
  grads = jax.tree.map(jnp.zeros_like, params)
  bias = ("layers_1", "mlp", "gate", "e_score_correction_bias")
  grads["layers_1"]["mlp"]["gate"]["e_score_correction_bias"] = jnp.ones((cfg.n_routed_experts,))
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
    keys = partition.names(path)
    p = params
    for k in keys:
      p = p[k]
    if keys == bias or u.ndim < 2:
      assert np.all(np.asarray(u) == 0), keys
    else:
      np.testing.assert_allclose(u, -lr * wd * p, rtol=1e-6, err_msg="/".join(keys))


def test_unknown_tensor_layout_is_a_clear_error():
  path = jax.tree_util.tree_flatten_with_path({"vision": {"patch_embed": {"kernel": jnp.zeros((2, 3, 4, 5))}}})
  (leaf_path, leaf), = path[0]
  with pytest.raises(ValueError, match="vision/patch_embed/kernel"):
    partition.matrix_axes(leaf_path, leaf.shape)


def test_muon_updates_have_adamw_like_rms():
  """0.2·sqrt(max(rows, cols))·NS(G) has RMS ≈ 0.2 for a random G (first step, lr = 1)."""
  rng = np.random.default_rng(0)
  params = {"layers_0": {"mlp": {"up_proj": {"kernel": jnp.zeros((64, 256))}},
                         "self_attn": {"q_b_proj": {"kernel": jnp.zeros((32, 4, 48))}}}}
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  tx = muonclip.muonclip(1.0, weight_decay=0.0)
  updates, _ = tx.update(grads, tx.init(params), params)
  for u in jax.tree.leaves(updates):
    rms = float(jnp.sqrt(jnp.mean(u ** 2)))
    assert 0.15 < rms < 0.25, rms
  assert optax.tree.norm(updates) > 0
