"""MoonViT-3D and the K25 model: shapes, packing, padding, the splice, bad input, sharding."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

from k25jax.model import config, k25, media, vision
from k25jax.train import sharding

TEXT = config.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                          num_hidden_layers=1, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                          q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                          moe_impl="dense")
VISION = config.VisionConfig(pos_emb_height=6, pos_emb_width=6, num_attention_heads=2, num_hidden_layers=1,
                             hidden_size=16, intermediate_size=24)
CFG = config.K25Config(text=TEXT, vision=VISION, projection_hidden_size=16, image_token_id=60,
                       video_token_id=61, vision_start_token_id=58, vision_end_token_id=59)
GRIDS = ((1, 4, 2), (2, 2, 4))      # an image (2 merged tokens) and a 2-frame chunk (2 merged tokens)


@pytest.fixture(scope="module")
def params():
  return k25.init_params(CFG, jax.random.PRNGKey(0))


def _pixels(grids, seed=0):
  n = sum(t * h * w for t, h, w in grids)
  return jax.random.normal(jax.random.PRNGKey(seed), (n, 3, 14, 14))


def _tokens(n_placeholders, seq=12):
  tokens = np.full((2, seq), 5, np.int32)
  tokens.reshape(-1)[3:3 + n_placeholders] = CFG.image_token_id
  return tokens


@functools.partial(jax.jit, static_argnums=2)
def _features(params, pixels, grids):
  return k25.K25(CFG).apply({"params": params}, pixels, grids, method=k25.K25.encode_media)


def test_num_media_tokens_pools_frames():
  assert vision.num_media_tokens((1, 4, 6)) == 6
  assert vision.num_media_tokens((4, 4, 6)) == 6


def test_packed_items_do_not_see_each_other(params):
  """Block-diagonal attention: an item's features are those it has when encoded alone."""
  pixels = _pixels(GRIDS)
  packed = _features(params, pixels, GRIDS)
  alone = [_features(params, pixels[:8], GRIDS[:1]), _features(params, pixels[8:], GRIDS[1:])]
  np.testing.assert_allclose(packed, np.concatenate(alone), atol=1e-5)


def test_padded_layout_under_jit_equals_the_static_grid(params):
  pixels = _pixels(GRIDS)
  layout = vision.patch_layout(GRIDS, VISION, num_patches=30, num_merged=7)
  padded = jnp.concatenate([pixels, jnp.full((30 - 24, 3, 14, 14), 3.0)])
  encode = jax.jit(lambda p, x, l: k25.K25(CFG).apply({"params": p}, x, l, method=k25.K25.encode_media))
  out = encode(params, padded, layout)
  assert out.shape == (7, TEXT.hidden_size)
  np.testing.assert_allclose(out[:4], _features(params, pixels, GRIDS), atol=1e-5)


def test_position_table_resize_is_torch_bicubic():
  """The per-patch taps reproduce F.interpolate(bicubic, align_corners=False) up and down."""
  table = np.random.default_rng(0).normal(size=(6, 6, 5)).astype(np.float32)
  for h, w in ((4, 10), (6, 6), (12, 2)):
    layout = vision.patch_layout(((1, h, w),), VISION.replace(merge_kernel_size=(1, 1)))
    ours = np.einsum("nk,nkd->nd", layout.pos_weight, table.reshape(36, 5)[layout.pos_index])
    ref = torch.nn.functional.interpolate(torch.from_numpy(table).permute(2, 0, 1)[None], size=(h, w),
                                          mode="bicubic", align_corners=False)[0].permute(1, 2, 0)
    np.testing.assert_allclose(ours, ref.reshape(h * w, 5).numpy(), atol=1e-5, err_msg=f"{h}x{w}")


def test_splice_fills_placeholders_in_row_major_order():
  h = jnp.zeros((2, 3, 2))
  mask = jnp.array([[False, True, False], [True, False, True]])
  features = jnp.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
  out = media.splice(h, features, mask)
  np.testing.assert_array_equal(out[..., 0], [[0, 1, 0], [2, 0, 3]])


def test_text_loss_trains_the_vision_tower(params):
  pixels = _pixels(GRIDS)
  tokens = jnp.asarray(_tokens(4))

  def loss(p):
    logits, _ = k25.K25(CFG).apply({"params": p}, tokens, pixels, GRIDS)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 7])

  grads = jax.jit(jax.grad(loss))(params)
  for part in ("vision_tower", "mm_projector"):
    norm = sum(float(jnp.sum(g * g)) for g in jax.tree.leaves(grads[part]))
    assert norm > 1e-8, part


def test_placeholder_count_mismatch_is_an_error(params):
  pixels = _pixels(GRIDS)
  with pytest.raises(ValueError, match="3 media placeholder tokens but its media need 4"):
    k25.check_media(_tokens(3), GRIDS, CFG)
  with pytest.raises(ValueError, match="5 media placeholder tokens but its media need 4"):
    k25.K25(CFG).apply({"params": params}, jnp.asarray(_tokens(5)), pixels, GRIDS)


def test_placeholders_that_split_an_item_are_an_error():
  tokens = _tokens(4)
  tokens[0, 6], tokens[0, 8] = 5, CFG.image_token_id     # runs of 3 and 1 over items of 2 and 2
  with pytest.raises(ValueError, match=r"the 3 media placeholders at row 0, columns 3..5 do not hold whole items"):
    k25.check_media(tokens, GRIDS, CFG)


def test_placeholders_without_media_are_an_error(params):
  with pytest.raises(ValueError, match="2 media placeholder tokens but no media"):
    k25.K25(CFG).apply({"params": params}, jnp.asarray(_tokens(2)))


def test_placeholder_count_mismatch_under_jit_is_flagged(params):
  run = jax.jit(lambda p, t, x: k25.K25(CFG).apply({"params": p}, t, x, GRIDS)[1]["media_mismatch"])
  pixels = _pixels(GRIDS)
  assert bool(run(params, jnp.asarray(_tokens(5)), pixels))
  assert not bool(run(params, jnp.asarray(_tokens(4)), pixels))


@pytest.mark.parametrize("grid, message", [
    (((1, 3, 4),), r"grid_thw\[0\] = \(1, 3, 4\): h and w must be multiples of merge_kernel_size"),
    (((1, 2, 2), (5, 2, 2)), r"grid_thw\[1\] = \(5, 2, 2\): a chunk has at most pos_emb_time=4"),
    (((0, 2, 2),), r"grid_thw\[0\] must be \(t, h, w\) with positive entries"),
    ((), "grid_thw is empty"),
])
def test_bad_grids_are_named(grid, message):
  with pytest.raises(ValueError, match=message):
    vision.check_grid(grid, VISION)


def test_pixel_count_must_match_the_grids(params):
  with pytest.raises(ValueError, match=r"pixel_values has shape \(20, 3, 14, 14\); the grids need \[24, 3, 14, 14\]"):
    _features(params, _pixels(GRIDS)[:20], GRIDS)


def test_bad_configs_are_named():
  with pytest.raises(ValueError, match="projection_hidden_size=32 must equal vision.hidden_size=16"):
    CFG.replace(projection_hidden_size=32)
  with pytest.raises(ValueError, match="image_token_id must lie in"):
    CFG.replace(image_token_id=64)
  with pytest.raises(ValueError, match="head dim 6 must be a multiple of 4"):
    VISION.replace(hidden_size=12)


def test_released_config_names_are_understood():
  """The released config.json spells the vision fields `vt_*` and the pad id
  `media_placeholder_token_id`; transformers' names come out."""
  released = {"text_config": TEXT.to_hf_dict(), "media_placeholder_token_id": 60, "video_token_id": 61,
              "vision_start_token_id": 58, "vision_end_token_id": 59,
              "vision_config": {"patch_size": 14, "init_pos_emb_height": 6, "init_pos_emb_width": 6,
                                "init_pos_emb_time": 4, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1,
                                "vt_hidden_size": 16, "vt_intermediate_size": 24, "merge_kernel_size": [2, 2],
                                "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal",
                                "mm_projector_type": "patchmerger", "projector_ln_eps": 1e-5}}
  assert config.K25Config.from_hf_dict(released, moe_impl="dense") == CFG
  with pytest.raises(ValueError, match="vision_config.merge_type='sd2' is not supported"):
    config.K25Config.from_hf_dict({**released, "vision_config": {**released["vision_config"],
                                                                 "merge_type": "sd2"}})


def test_vision_params_shard_by_their_logical_axes(params):
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "data": -1})
  specs = sharding.mesh_specs(k25.abstract_params(CFG))
  block = specs["vision_tower"]["encoder"]["blocks_0"]
  assert block["wqkv"]["kernel"] == P("fsdp", None, "tensor", None)
  assert block["mlp"]["fc0"]["kernel"] == P("fsdp", "tensor")
  assert specs["mm_projector"]["proj_2"]["kernel"] == P("tensor", ("fsdp", "sequence"))   # the decoder's width
  placed = jax.device_put(params, sharding.logical_to_sharding(k25.abstract_params(CFG), mesh))
  assert placed["vision_tower"]["encoder"]["blocks_0"]["wqkv"]["kernel"].sharding.spec == P("fsdp", None, "tensor", None)


def test_k25_preset_parameter_counts():
  """MoonViT-3D: 27 × (4D² + 2DI + 9D + I) + conv 588·D + D + table 64²·D + final LN 2D."""
  counts = k25.param_counts_by_part(config.k25_preset("k25"))
  d, i = 1152, 4304
  assert counts["vision_tower"] == 27 * (4 * d * d + 2 * d * i + 9 * d + i) + 589 * d + 64 * 64 * d + 2 * d
  assert counts["mm_projector"] == 2 * d + (4 * d) ** 2 + 4 * d + 4 * d * 7168 + 7168
  assert counts["total"] == sum(counts[k] for k in ("language_model", "vision_tower", "mm_projector"))
  assert counts["language_model"] == config.param_counts(config.preset("k25"))["total"]
