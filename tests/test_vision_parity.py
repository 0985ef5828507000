"""Parity with transformers' Kimi_K25ForConditionalGeneration on a tiny random checkpoint:
vision features of an image and a 4-frame chunk packed together, logits with media in the
prompt, both checkpoint layouts on load, and save → transformers load."""
import jax
import numpy as np
import pytest
import torch
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

from hf_fixtures import tiny_hf_config
from k25jax.convert import hf
from k25jax.model import k25, vision

TOL = 1e-4
IMAGE_ID, VIDEO_ID, START_ID, END_ID = 90, 91, 88, 89
# The image has more rows than the 8×8 position table (bicubic upsampling) and fewer columns
# (downsampling); the chunk's width equals the table's (identity on that axis).
IMAGE_GRID, VIDEO_GRID = (1, 10, 6), (4, 4, 8)


def tiny_k25_hf_config(text=None, **overrides) -> Kimi_K25Config:
  """Two text layers (`text`: the text config's fields to change), two vision blocks; the
  media ids above unless overridden."""
  vision_cfg = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=2,
                    num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                    rope_parameters=dict(rope_type="axial", rope_theta=10000.0))
  text = tiny_hf_config(**{"num_hidden_layers": 2, **(text or {})}).to_dict()
  ids = dict(image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID,
             vision_end_token_id=END_ID)
  return Kimi_K25Config(text_config=text, vision_config=vision_cfg, projection_hidden_size=32,
                        tie_word_embeddings=False, **{**ids, **overrides})


def random_k25_model(seed: int = 0, config: Kimi_K25Config | None = None) -> Kimi_K25ForConditionalGeneration:
  """Random weights large enough that attention and the projector are far from trivial
  (`config`: default tiny_k25_hf_config())."""
  torch.manual_seed(seed)
  model = Kimi_K25ForConditionalGeneration(config or tiny_k25_hf_config()).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name and name.endswith("weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif "position_embeddings" in name:
        p.normal_(0.0, 1.0)
      elif "vision_tower" in name or "mm_projector" in name:
        p.normal_(0.0, 0.1 if name.endswith("bias") else 0.2)
      else:
        p.normal_(0.0, 0.25)
    for layer in model.model.language_model.layers[1:]:
      layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
  return model


def _pixels(grid, seed):
  n = int(np.prod(grid))
  return np.random.default_rng(seed).uniform(-1, 1, size=(n, 3, 14, 14)).astype(np.float32)


def _prompt():
  """Row 0 holds the image's placeholders, row 1 the chunk's (filled in row-major order)."""
  rng = np.random.default_rng(3)
  rows = []
  for grid, token in ((IMAGE_GRID, IMAGE_ID), (VIDEO_GRID, VIDEO_ID)):
    n = vision.num_media_tokens(grid)
    rows.append(list(rng.integers(0, 80, 3)) + [START_ID] + [token] * n + [END_ID]
                + list(rng.integers(0, 80, 24 - n)))
  return np.array(rows, np.int64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  model = random_k25_model()
  released = str(tmp_path_factory.mktemp("released"))
  native = str(tmp_path_factory.mktemp("native"))
  model.save_pretrained(released)                              # transformers writes the released layout
  model.save_pretrained(native, save_original_format=False)   # its in-memory names
  image, video = _pixels(IMAGE_GRID, 1), _pixels(VIDEO_GRID, 2)
  tokens = _prompt()
  with torch.no_grad():
    pixels = torch.from_numpy(np.concatenate([image, video]))
    grids = torch.tensor([IMAGE_GRID, VIDEO_GRID])
    merged = model.model.vision_tower(pixels, grid_thw=grids).pooler_output
    features = model.model.mm_projector(merged).squeeze(1)
    logits = model(torch.from_numpy(tokens), pixel_values=torch.from_numpy(image),
                   image_grid_thw=torch.tensor([IMAGE_GRID]), pixel_values_videos=torch.from_numpy(video),
                   video_grid_thw=torch.tensor([VIDEO_GRID])).logits
  return dict(released=released, native=native, image=image, video=video, tokens=tokens,
              merged=merged.numpy(), features=features.numpy(), logits=logits.numpy())


@pytest.fixture(scope="module")
def loaded(checkpoint):
  return hf.load(checkpoint["released"])


def jax_paths(tree):
  return [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_leaves_with_path(tree)]


def _apply(cfg, params, *args, **kwargs):
  return k25.K25(cfg).apply({"params": params}, *args, **kwargs)


def test_vision_features_of_a_packed_image_and_chunk_match(checkpoint, loaded):
  cfg, params = loaded
  pixels = np.concatenate([checkpoint["image"], checkpoint["video"]])
  grids = (IMAGE_GRID, VIDEO_GRID)
  merged = vision.MoonViT3D(cfg.vision).apply({"params": params["vision_tower"]}, pixels, grids)
  features = _apply(cfg, params, pixels, grids, method=k25.K25.encode_media)
  assert merged.shape == (15 + 8, 4, 32) and np.abs(checkpoint["features"]).max() > 0.5
  np.testing.assert_allclose(np.asarray(merged), checkpoint["merged"], atol=TOL, rtol=0)
  np.testing.assert_allclose(np.asarray(features), checkpoint["features"], atol=TOL, rtol=0)


@pytest.mark.slow
def test_logits_with_media_in_the_prompt_match(checkpoint, loaded):
  cfg, params = loaded
  pixels = np.concatenate([checkpoint["image"], checkpoint["video"]])
  logits, aux = _apply(cfg, params, checkpoint["tokens"].astype(np.int32), pixels, (IMAGE_GRID, VIDEO_GRID))
  assert not bool(aux["media_mismatch"])
  np.testing.assert_allclose(np.asarray(logits), checkpoint["logits"], atol=TOL, rtol=0)


def test_native_layout_loads_to_the_same_params(checkpoint, loaded):
  cfg, params = loaded
  native_cfg, native_params = hf.load(checkpoint["native"])
  assert native_cfg == cfg
  for ours, native in zip(jax_paths(params), jax_paths(native_params)):
    assert ours[0] == native[0]
    np.testing.assert_array_equal(np.asarray(ours[1]), np.asarray(native[1]), err_msg=ours[0])


def test_save_round_trip_loads_in_transformers(checkpoint, loaded, tmp_path):
  cfg, params = loaded
  hf.save(cfg, params, str(tmp_path))
  reloaded_cfg, reloaded = hf.load(str(tmp_path))
  assert reloaded_cfg == cfg
  for ours, back in zip(jax_paths(params), jax_paths(reloaded)):
    assert ours[0] == back[0]
    np.testing.assert_array_equal(np.asarray(ours[1]), np.asarray(back[1]), err_msg=ours[0])
  model, info = Kimi_K25ForConditionalGeneration.from_pretrained(str(tmp_path), output_loading_info=True)
  assert not any(info.values()), info
  with torch.no_grad():
    logits = model.eval()(torch.from_numpy(checkpoint["tokens"]),
                          pixel_values=torch.from_numpy(checkpoint["image"]),
                          image_grid_thw=torch.tensor([IMAGE_GRID]),
                          pixel_values_videos=torch.from_numpy(checkpoint["video"]),
                          video_grid_thw=torch.tensor([VIDEO_GRID])).logits
  np.testing.assert_allclose(logits.numpy(), checkpoint["logits"], atol=TOL, rtol=0)


def test_text_only_load_of_a_multimodal_folder(checkpoint, loaded):
  cfg, params = loaded
  text_cfg, text_params = hf.load(checkpoint["released"], text_only=True)
  assert text_cfg == cfg.text
  assert jax_paths(text_params)[0][0] == jax_paths(params["language_model"])[0][0]


@pytest.mark.slow
def test_hf_checkpoint_starts_k25_and_text_runs_from_either_folder(checkpoint, loaded, tmp_path):
  """init.hf_checkpoint's K2.5 paths (k25jax/train/hf_init.py): a K2.5 run from a K2.5 folder
  gets every param; from a text folder its language model, the tower and projector fresh; a
  text run from a K2.5 folder gets the language model."""
  from k25jax.model import transformer
  from k25jax.train import hf_init, sharding, trainer as trainer_lib
  cfg, params = loaded
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])

  def start(model, path):
    shardings = sharding.logical_to_sharding(trainer_lib.abstract_params(model), mesh)
    return hf_init.load_params(model, path, shardings, lambda: trainer_lib.fresh_params(model, mesh, 0))

  def equal(a, b):
    assert [p for p, _ in jax_paths(a)] == [p for p, _ in jax_paths(b)]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))

  multimodal = k25.K25(cfg)
  equal(start(multimodal, checkpoint["released"]), params)
  text_folder = str(tmp_path / "text")
  hf.save(cfg.text, params[k25.LANGUAGE_MODEL], text_folder)
  from_text = start(multimodal, text_folder)
  equal(from_text[k25.LANGUAGE_MODEL], params[k25.LANGUAGE_MODEL])
  fresh = jax.device_get(trainer_lib.fresh_params(multimodal, mesh, 0))
  equal({k: v for k, v in from_text.items() if k != k25.LANGUAGE_MODEL},
        {k: v for k, v in fresh.items() if k != k25.LANGUAGE_MODEL})
  equal(start(transformer.Transformer(cfg.text), checkpoint["released"]), params[k25.LANGUAGE_MODEL])
  with pytest.raises(ValueError, match=r"describes another model: text\.hidden_size"):
    start(k25.K25(cfg.replace(text=cfg.text.replace(hidden_size=2 * cfg.text.hidden_size))), checkpoint["released"])
