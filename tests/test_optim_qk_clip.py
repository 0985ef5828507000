"""QK-Clip on the tiny model: clipped heads end at tau, everything else keeps its bits."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k25jax.model import config, transformer
from k25jax.model.attention import MLA
from k25jax.optim import muonclip, partition

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2,
             q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             moe_impl="dense")


def random_params(cfg, seed=0):
  """Norm weights 1, every other tensor N(0, 0.3²): large enough for logits of order 10."""
  rng = np.random.default_rng(seed)
  shapes = nn.meta.unbox(transformer.abstract_params(cfg))
  fill = lambda path, s: (jnp.ones(s.shape) if partition.names(path)[-1] == "weight"
                          else jnp.asarray(0.3 * rng.normal(size=s.shape), jnp.float32))
  return jax.tree_util.tree_map_with_path(fill, shapes)


def attention_inputs(cfg, params, tokens):
  """Each layer's attention input (the output of its input_layernorm) on `tokens`."""
  _, state = transformer.Transformer(cfg).apply(
      {"params": params}, tokens, capture_intermediates=lambda mdl, _: mdl.name == "input_layernorm",
      mutable=["intermediates"])
  inter = state["intermediates"]
  return [inter[f"layers_{i}"]["input_layernorm"]["__call__"][0] for i in range(cfg.num_hidden_layers)]


@pytest.fixture(scope="module", params=[{}, {"q_lora_rank": None}], ids=["q_lora", "q_proj"])
def clipped(request):
  cfg = config.preset("tiny", **{**SMALL, **request.param})
  params = random_params(cfg)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
  _, aux = jax.jit(transformer.Transformer(cfg).apply)({"params": params}, tokens)
  inputs = jax.jit(attention_inputs, static_argnums=0)(cfg, params, tokens)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  mla_max = jax.jit(lambda p, x: MLA(cfg).apply({"params": p}, x, positions)[1])
  per_layer = lambda p: np.stack([mla_max(p[f"layers_{i}"]["self_attn"], x) for i, x in enumerate(inputs)])
  before = np.asarray(aux["max_logits"])
  np.testing.assert_allclose(per_layer(params), before, rtol=1e-5)   # the recomputation is faithful
  tau = float(np.median(before))
  new_params, metrics = jax.jit(muonclip.qk_clip, static_argnums=2)(params, aux["max_logits"], tau)
  return dict(cfg=cfg, params=params, new=new_params, metrics=metrics, before=before,
              after=per_layer(new_params), tau=tau)


def test_clipped_heads_end_at_tau(clipped):
  tau, before, after = clipped["tau"], clipped["before"], clipped["after"]
  hit = before > tau
  assert 0 < hit.sum() < hit.size
  assert np.all(after[hit] <= tau * (1 + 1e-4))
  np.testing.assert_allclose(after[hit], tau, rtol=1e-4)
  np.testing.assert_array_equal(after[~hit], before[~hit])


def test_metrics(clipped):
  m, before, tau = clipped["metrics"], clipped["before"], clipped["tau"]
  assert int(m["clipped_heads"]) == int((before > tau).sum())
  assert float(m["max_logit"]) == before.max()
  np.testing.assert_array_equal(m["max_logit_per_layer"], before.max(axis=1))


def test_only_q_and_k_nope_of_clipped_heads_change(clipped):
  cfg, old, new, before, tau = (clipped[k] for k in ("cfg", "params", "new", "before", "tau"))
  nope = cfg.qk_nope_head_dim
  q_name = "q_b_proj" if cfg.q_lora_rank else "q_proj"
  for i in range(cfg.num_hidden_layers):
    attn_old, attn_new = old[f"layers_{i}"]["self_attn"], new[f"layers_{i}"]["self_attn"]
    gamma = np.where(before[i] > tau, tau / before[i], 1.0)
    q_old, q_new = np.asarray(attn_old[q_name]["kernel"]), np.asarray(attn_new[q_name]["kernel"])
    kv_old, kv_new = np.asarray(attn_old["kv_b_proj"]["kernel"]), np.asarray(attn_new["kv_b_proj"]["kernel"])
    for h in range(cfg.num_attention_heads):
      if gamma[h] == 1.0:
        np.testing.assert_array_equal(q_new[:, h], q_old[:, h])
        np.testing.assert_array_equal(kv_new[:, h], kv_old[:, h])
      else:
        np.testing.assert_allclose(q_new[:, h, :nope], np.sqrt(gamma[h]) * q_old[:, h, :nope], rtol=1e-6)
        np.testing.assert_allclose(q_new[:, h, nope:], gamma[h] * q_old[:, h, nope:], rtol=1e-6)
        np.testing.assert_allclose(kv_new[:, h, :nope], np.sqrt(gamma[h]) * kv_old[:, h, :nope], rtol=1e-6)
    np.testing.assert_array_equal(kv_new[..., nope:], kv_old[..., nope:])          # v
  # Every other tensor (the shared rope key in kv_a_proj_with_mqa included) keeps its bits.
  changed = {q_name, "kv_b_proj"}
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(old)[0], jax.tree.leaves(new)):
    if not changed & set(partition.names(path)):
      np.testing.assert_array_equal(a, b, err_msg="/".join(partition.names(path)))


def test_nothing_changes_below_tau(clipped):
  params, before = clipped["params"], clipped["before"]
  new, metrics = muonclip.qk_clip(params, jnp.asarray(before), float(before.max()))
  assert int(metrics["clipped_heads"]) == 0
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new)):
    np.testing.assert_array_equal(a, b)
