"""Scanned MoE layers: same model as per layer; checkpoints convert to per-layer and HF names."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import traverse_util
from transformers import DeepseekV3ForCausalLM

from k25jax.convert import hf, scan
from k25jax.model import attention, config, transformer
from k25jax.optim import muonclip, partition
from k25jax.train import checkpoint, state as state_lib

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
             first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
             qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
             initializer_range=0.3)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)


def apply(cfg, params):
  return jax.jit(transformer.Transformer(cfg).apply)({"params": params}, TOKENS)


@pytest.fixture(scope="module")
def models():
  """Per-layer params and their scanned copy, with each model's (logits, aux) on TOKENS."""
  cfg = config.preset("tiny", **SMALL)
  scanned_cfg = cfg.replace(scan_layers=True, remat_policy="full")
  params = jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
  scanned = scan.stack_layers(cfg, params)
  return dict(cfg=cfg, params=params, out=apply(cfg, params), scanned_cfg=scanned_cfg, scanned=scanned,
              scanned_out=apply(scanned_cfg, scanned))


def test_scanned_equals_per_layer_logits_and_aux(models):
  (ref_logits, ref_aux), (logits, aux) = models["out"], models["scanned_out"]
  assert np.abs(ref_logits).max() > 1.0
  np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
  assert set(aux) == set(ref_aux)
  for name in aux:
    assert aux[name].shape == ref_aux[name].shape, name
    np.testing.assert_allclose(aux[name], ref_aux[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_scanned_init_has_the_stacked_layout():
  cfg = config.preset("tiny", **SMALL, scan_layers=True)
  boxed = transformer.abstract_params(cfg)
  assert sorted(k for k in boxed if k.startswith("layers_")) == ["layers_0"]
  gate = boxed[transformer.SCANNED]["mlp"]["experts"]["gate_proj"]
  assert gate.names == ("layers", "exp", "embed", "moe_mlp")
  assert gate.value.shape == (2, 4, 32, 16)


def test_checkpoint_saved_scanned_loads_per_layer_and_exports_to_hf(models, tmp_path):
  cfg, scanned_cfg, scanned = models["cfg"], models["scanned_cfg"], models["scanned"]
  state = state_lib.create(scanned, optax.sgd(0.1), jax.random.PRNGKey(0))
  saver = checkpoint.Checkpoints(str(tmp_path / "run"), keep=1)
  saver.save(1, state)
  saver.close()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), scanned)
  restored = checkpoint.restore_params(str(tmp_path / "run"), target)
  per_layer = traverse_util.flatten_dict(scan.unstack_layers(cfg, restored))
  for key, value in traverse_util.flatten_dict(models["params"]).items():   # the per-layer model's params
    np.testing.assert_array_equal(per_layer[key], value, err_msg="/".join(key))

  hf.save(scanned_cfg, restored, str(tmp_path / "hf"))
  model, info = DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
  assert not any(info.values()), info                  # no missing, unexpected or mismatched tensor
  with torch.no_grad():
    theirs = model.eval()(torch.tensor(np.asarray(TOKENS), dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(theirs, models["scanned_out"][0], atol=1e-4, rtol=0)

  loaded_cfg, loaded = hf.load(str(tmp_path / "hf"), scan_layers=True)
  assert loaded_cfg.scan_layers and scan.is_scanned(loaded)
  flat = traverse_util.flatten_dict(scanned)
  for key, value in traverse_util.flatten_dict(loaded).items():
    np.testing.assert_array_equal(value, flat[key], err_msg="/".join(key))


def test_optimizer_routes_stacked_leaves_per_layer():
  boxed = transformer.abstract_params(config.preset("tiny", **SMALL, scan_layers=True))
  params = jax.tree.map(lambda b: b.value, boxed, is_leaf=lambda x: hasattr(x, "names"))
  labels = traverse_util.flatten_dict(partition.labels(params))
  stacked = transformer.SCANNED
  assert labels[(stacked, "input_layernorm", "weight")] == partition.ADAMW          # [layers, d]: a vector
  assert labels[(stacked, "mlp", "gate", "e_score_correction_bias")] == partition.FROZEN
  assert labels[(stacked, "mlp", "gate", "kernel")] == partition.ADAMW
  assert labels[(stacked, "self_attn", "q_b_proj", "kernel")] == partition.MUON
  assert not traverse_util.flatten_dict(partition.matrix_mask(params))[(stacked, "input_layernorm", "weight")]
  path = [jax.tree_util.DictKey(k) for k in (stacked, "mlp", "experts", "gate_proj")]
  assert partition.matrix_axes(path, (2, 4, 32, 16)) == partition.MatrixAxes((0, 1), (2,), (3,))
  path = [jax.tree_util.DictKey(k) for k in (stacked, "self_attn", "o_proj", "kernel")]
  assert partition.matrix_axes(path, (2, 2, 8, 32)) == partition.MatrixAxes((0,), (1, 2), (3,))


def test_muonclip_qk_clip_and_router_bias_update_each_layer_of_the_stack():
  """The optimizer update, QK-Clip and the router-bias update of scanned params equal the
  per-layer ones, layer by layer (the train step applies exactly these)."""
  from k25jax.train import step
  cfg = config.preset("tiny", **SMALL)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda b: jnp.asarray(rng.normal(size=b.value.shape), jnp.float32),
                        transformer.abstract_params(cfg), is_leaf=lambda x: hasattr(x, "names"))
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  max_logits = jnp.asarray(rng.uniform(50.0, 150.0, (cfg.num_hidden_layers, cfg.num_attention_heads)))
  load = jnp.asarray(rng.integers(0, 9, (cfg.num_moe_layers, cfg.n_routed_experts)), jnp.float32)

  @jax.jit
  def update(p, g):
    tx = muonclip.muonclip(0.1, weight_decay=0.1, ns_steps=1)
    u, _ = tx.update(g, tx.init(p), p)
    p, _ = muonclip.qk_clip(optax.apply_updates(p, u), max_logits, tau=100.0)
    return step.update_router_biases(p, load, 1e-3, cfg.first_k_dense_replace)

  ref = update(params, grads)
  new = scan.unstack_layers(cfg, update(scan.stack_layers(cfg, params), scan.stack_layers(cfg, grads)))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new)[0], jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_decode_cache_needs_per_layer_params():
  cfg = config.preset("tiny", **SMALL, scan_layers=True)
  params = jax.tree.map(lambda b: b.value, transformer.abstract_params(cfg), is_leaf=lambda x: hasattr(x, "names"))
  with pytest.raises(ValueError, match="scan_layers=False"):
    jax.eval_shape(lambda p: transformer.Transformer(cfg).apply({"params": p}, TOKENS[:, :1],
                                                                  cache=attention.init_cache(cfg, 2, 8)), params)


def test_conversion_errors_name_the_problem():
  cfg = config.preset("tiny", **SMALL)
  params = jax.tree.map(lambda b: np.zeros(b.value.shape), transformer.abstract_params(cfg),
                        is_leaf=lambda x: hasattr(x, "names"))
  scanned = scan.stack_layers(cfg, params)
  with pytest.raises(ValueError, match="already scanned"):
    scan.stack_layers(cfg, scanned)
  with pytest.raises(ValueError, match="not scanned"):
    scan.unstack_layers(cfg, params)
  with pytest.raises(ValueError, match="holds \\[2\\] layers"):
    scan.unstack_layers(cfg.replace(num_hidden_layers=5), scanned)
