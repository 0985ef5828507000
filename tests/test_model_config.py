"""Config presets, analytic parameter counts, and validation errors that name the field."""
import flax.linen as nn
import jax
import numpy as np
import pytest

from k25jax.model import config, transformer


def _leaf_count(cfg):
  shapes = nn.meta.unbox(transformer.abstract_params(cfg))
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))


@pytest.mark.parametrize("name", ["tiny", "small", "moonlight", "k25"])
def test_eval_shape_matches_analytic_count(name):
  cfg = config.preset(name)
  assert _leaf_count(cfg) == config.param_counts(cfg)["total"]


def test_k25_counts_are_the_released_model():
  counts = config.param_counts(config.preset("k25"))
  print(f"k25 total {counts['total']:,} active {counts['active']:,}")
  assert 1.02e12 < counts["total"] < 1.04e12      # "1.04T" in the K2 report counts 1.03T text params
  assert 32.0e9 < counts["active"] < 33.5e9       # "32B activated"


def test_moonlight_is_the_published_16b_a3b():
  """Moonlight-16B-A3B: 15.96B params by eval_shape and by count, 2.91B activated a token."""
  cfg = config.preset("moonlight")
  counts = config.param_counts(cfg)
  assert counts == {"total": 15_960_110_208, "active": 2_914_776_192}
  assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
          cfg.n_shared_experts, cfg.q_lora_rank, cfg.vocab_size) == (27, 2048, 64, 6, 2, None, 163840)


def test_k25_facts():
  cfg = config.preset("k25")
  assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (7168, 61, 64)
  assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.vocab_size) == (384, 8, 163840)
  assert cfg.qk_head_dim == 192
  assert abs(config.yarn_attention_mscale(cfg) ** 2 * cfg.qk_head_dim ** -0.5
             - 192 ** -0.5 * (0.1 * np.log(64) + 1) ** 2) < 1e-12


@pytest.mark.parametrize("field, value, match", [
    ("num_experts_per_tok", 17, "num_experts_per_tok"),
    ("n_group", 3, "n_group"),
    ("topk_group", 2, "topk_group"),
    ("qk_rope_head_dim", 15, "qk_rope_head_dim"),
    ("first_k_dense_replace", 9, "first_k_dense_replace"),
    ("moe_impl", "magic", "moe_impl"),
    ("hidden_size", 0, "hidden_size"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling"),
    ("rope_scaling", {"type": "yarn", "factor": 2.0}, "original_max_position_embeddings"),
])
def test_inconsistent_config_names_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    config.preset("tiny", **{field: value})


def test_unknown_preset():
  with pytest.raises(ValueError, match="unknown model preset"):
    config.preset("huge")


def test_hf_dict_round_trip_keeps_every_field():
  cfg = config.preset("k25")
  again = config.ModelConfig.from_hf_dict(cfg.to_hf_dict(), dtype=cfg.dtype, param_dtype=cfg.param_dtype)
  assert again == cfg


def test_vision_attention_impl_is_ours_and_checked():
  """Not a Hugging Face field: left out of vision_config, set by the caller of from_hf_dict (for
  the decoder and the vision tower alike), and a bad value names the field."""
  cfg = config.k25_preset("tiny")
  hf_dict = cfg.to_hf_dict()
  assert "attention_impl" not in hf_dict["vision_config"]
  again = config.K25Config.from_hf_dict(hf_dict, attention_impl="pallas")
  assert (again.text.attention_impl, again.vision.attention_impl) == ("pallas", "pallas")
  with pytest.raises(ValueError, match="VisionConfig.attention_impl"):
    cfg.vision.replace(attention_impl="flash")
