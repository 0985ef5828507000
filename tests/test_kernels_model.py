"""The tiny model and vision tower with attention_impl/moe_impl = pallas (interpreted) equal the XLA paths."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k25jax.model import attention, config, transformer, vision


def _close(actual, expected, rtol):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


SMALL = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=32,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64)
XLA = config.preset("tiny", **SMALL)
PALLAS = XLA.replace(attention_impl="pallas", moe_impl="pallas")


@pytest.fixture(scope="module")
def params():
  return jax.jit(transformer.init_params, static_argnums=0)(XLA, jax.random.PRNGKey(0))


def _loss(cfg, tokens, positions, segments):
  """θ -> (mean first-token log-prob + balance loss, (logits, aux)) of the model at `cfg`."""
  def fn(p):
    logits, aux = transformer.Transformer(cfg).apply({"params": p}, tokens, positions, segments)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + aux["balance_loss"], (logits, aux)
  return fn


def _random_cache(rng, rows: int = 2, slots: int = 32) -> list[dict]:
  """A latent cache of the small model filled with normal noise."""
  return [{name: jnp.asarray(rng.normal(size=x.shape), jnp.float32) for name, x in layer.items()}
          for layer in attention.init_cache(XLA, rows, slots)]


def test_auto_is_xla_on_cpu():
  assert attention.attention_impl(XLA.replace(attention_impl="auto")) == ("xla" if jax.default_backend() == "cpu"
                                                                          else "pallas")


@pytest.mark.slow
def test_pallas_logits_and_gradients_equal_xla(params):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 21)), jnp.int32)               # 21: not a block multiple
  segments = jnp.asarray([[1] * 12 + [2] * 9, [1] * 16 + [0] * 5], jnp.int32)
  positions = jnp.asarray([list(range(12)) + list(range(9)), list(range(16)) + [0] * 5], jnp.int32)
  loss = lambda cfg: _loss(cfg, tokens, positions, segments)
  (_, (logits, aux)), grads = jax.jit(jax.value_and_grad(loss(PALLAS), has_aux=True))(params)
  (_, (ref_logits, ref_aux)), ref_grads = jax.jit(jax.value_and_grad(loss(XLA), has_aux=True))(params)
  _close(logits, ref_logits, 1e-5)
  _close(aux["max_logits"], ref_aux["max_logits"], 1e-5)
  np.testing.assert_array_equal(aux["expert_load"], ref_aux["expert_load"])
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    ref = ref_grads
    for key in path:
      ref = ref[key.key]
    _close(g, ref, 1e-5)


def test_pallas_decode_equals_xla(params):
  """Rows at different positions of one latent cache: one decode step, both paths."""
  rng = np.random.default_rng(1)
  cache = _random_cache(rng)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 1)), jnp.int32)
  positions = jnp.asarray([[0], [31]], jnp.int32)                               # length 1 and the full cache
  outs = [jax.jit(lambda p, c, cfg=cfg: transformer.Transformer(cfg).apply({"params": p}, tokens, positions,
                                                                           cache=c))(params, cache)
          for cfg in (PALLAS, XLA)]
  _close(outs[0][0], outs[1][0], 1e-5)
  _close(outs[0][1]["max_logits"], outs[1][1]["max_logits"], 1e-5)


@pytest.mark.slow
def test_pallas_kernels_under_a_mesh_equal_xla(params):
  """On fsdp 2 × sequence 2 × tensor 2 (the rows over fsdp and sequence, the heads over sequence
  × tensor): the flash kernel on whole rows of each device's heads, the routing and expert
  kernels on each device's tokens, the decode kernel on each device's cache rows. Logits,
  expert loads, gradients and one decode step equal the unsharded XLA model."""
  from k25jax.train import sharding
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 24)), jnp.int32)
  segments = jnp.asarray([[1] * 14 + [2] * 10, [1] * 20 + [0] * 4], jnp.int32)
  positions = jnp.asarray([list(range(14)) + list(range(10)), list(range(20)) + [0] * 4], jnp.int32)
  loss = lambda cfg: _loss(cfg, tokens, positions, segments)
  cache = _random_cache(rng)
  step_tokens, step_positions = jnp.asarray([[5], [9]], jnp.int32), jnp.asarray([[3], [31]], jnp.int32)
  decode = lambda cfg: jax.jit(lambda p, c: transformer.Transformer(cfg).apply(
      {"params": p}, step_tokens, step_positions, cache=c))
  with jax.set_mesh(sharding.make_mesh(dict(fsdp=2, sequence=2, tensor=2))), nn.logical_axis_rules(sharding.RULES):
    (_, (logits, aux)), grads = jax.jit(jax.value_and_grad(loss(PALLAS), has_aux=True))(params)
    step_out, step_aux = decode(PALLAS)(params, cache)[:2]
  (_, (ref_logits, ref_aux)), ref_grads = jax.jit(jax.value_and_grad(loss(XLA), has_aux=True))(params)
  ref_step, ref_step_aux = decode(XLA)(params, cache)[:2]
  _close(logits, ref_logits, 1e-5)
  np.testing.assert_array_equal(aux["expert_load"], ref_aux["expert_load"])
  jax.tree.map(lambda g, r: _close(g, r, 1e-5), grads, ref_grads)
  _close(step_out, ref_step, 1e-5)
  _close(step_aux["max_logits"], ref_step_aux["max_logits"], 1e-5)


VISION = config.VisionConfig(pos_emb_height=6, pos_emb_width=6, num_attention_heads=2, num_hidden_layers=2,
                             hidden_size=16, intermediate_size=24, attention_impl="xla")
GRIDS = ((1, 4, 6), (2, 2, 4), (1, 2, 2))   # an image, a 2-frame chunk, a small image: 44 patches, 9 merged


def test_vision_auto_is_xla_on_cpu():
  assert attention.attention_impl(VISION.replace(attention_impl="auto")) == (
      "xla" if jax.default_backend() == "cpu" else "pallas")


@pytest.mark.slow
def test_vision_tower_pallas_features_and_gradients_equal_xla():
  layout = vision.patch_layout(GRIDS, VISION, num_patches=48, num_merged=12)     # 4 padding patches
  pixels = jax.random.normal(jax.random.PRNGKey(0), (48, 3, 14, 14))
  params = nn.meta.unbox(vision.MoonViT3D(VISION).init(jax.random.PRNGKey(1), pixels, layout)["params"])

  def loss(cfg):
    def fn(p):
      merged = vision.MoonViT3D(cfg).apply({"params": p}, pixels, layout)
      return jnp.sum(jnp.sin(merged)), merged
    return jax.jit(jax.value_and_grad(fn, has_aux=True))

  (_, merged), grads = loss(VISION.replace(attention_impl="pallas"))(params)
  (_, ref_merged), ref_grads = loss(VISION)(params)
  _close(merged, ref_merged, 1e-5)
  jax.tree.map(lambda g, r: _close(g, r, 1e-5), grads, ref_grads)
