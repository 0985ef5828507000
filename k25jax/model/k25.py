"""Kimi K2.5, the multimodal model: MoonViT-3D → projector → spliced into the K2 decoder.

    merged = vision_tower(pixel_values, grid_thw)        [M, kh·kw, D_vit]
    feats  = mm_projector(merged)                        [M, D_text]
    h_0    = embed(tokens), placeholder rows ← feats in order (see `media`)
    logits = language_model(h_0)

Params: {LANGUAGE_MODEL: the Transformer's, VISION_TOWER: ..., PROJECTOR: ...}
(the keys "language_model", "vision_tower", "mm_projector").

    model = K25(cfg)
    logits, aux = model.apply({"params": params}, tokens, pixel_values, grid_thw)

grid_thw: a static tuple of (t, h, w) per item (one compilation per distinct tuple) or a
`vision.PatchLayout` (jit arguments, padded to a budget). Media in D shards: pixel_values
[D, N, 3, p, p] and a PatchLayout whose arrays lead with D; the rows split into D consecutive
groups, and group d's placeholders take shard d's features in order (each shard is encoded
on its own: under a mesh, by the devices holding its rows). Call `check_media(tokens, grid_thw,
cfg)` on the host before jit: it raises on a placeholder count that does not match the media.
Inside jit the count cannot raise; aux["media_mismatch"] is then True (see `media.splice`).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k25jax.model import media, sequence_parallel, vision
from k25jax.model.config import K25Config
from k25jax.model.transformer import Transformer

# The top-level keys of the K2.5 params (the submodules of `K25`).
LANGUAGE_MODEL, VISION_TOWER, PROJECTOR = "language_model", "vision_tower", "mm_projector"


def check_media(tokens, grid_thw: vision.Grid | None, cfg: K25Config) -> None:
  """Host-side check that the placeholders of `tokens` match the media (None: no media).

  Validates the grids (`vision.check_grid`), then `media.check_placeholders`: exactly
  Σ_items h·w/(kh·kw) placeholders, each run holding whole items in order. Raises ValueError.
  """
  mask = media.placeholder_mask(np.asarray(tokens), cfg.media_token_ids)
  if grid_thw is None:
    if mask.any():
      raise ValueError(f"the prompt has {int(mask.sum())} media placeholder tokens but no media "
                       "(pixel_values/grid_thw are None)")
    return
  grids = vision.check_grid(grid_thw, cfg.vision)
  media.check_placeholders(mask, [vision.num_media_tokens(g, cfg.vision.merge_kernel_size) for g in grids])


class K25(nn.Module):
  """Kimi_K25ForConditionalGeneration: the text model with media features spliced in."""

  cfg: K25Config

  def setup(self):
    cfg = self.cfg
    self.language_model = Transformer(cfg.text)
    self.vision_tower = vision.MoonViT3D(cfg.vision)
    self.mm_projector = vision.Projector(cfg.vision, cfg.text.hidden_size,
                                         eps=cfg.projection_layer_norm_eps)

  def encode_media(self, pixel_values: jax.Array, grid_thw) -> jax.Array:
    """Projector outputs [M, text hidden], the rows that replace the placeholders in order;
    [D, M, text hidden] for media in D shards (pixel_values [D, N, 3, p, p]), each shard encoded
    by the devices of its data shard (the vmap's axis split over the batch mesh axes)."""
    if pixel_values.ndim == 5:
      per_shard = nn.vmap(lambda module, pixels, layout: module.encode_media(pixels, layout),
                          variable_axes={"params": None}, split_rngs={"params": False},
                          spmd_axis_name=sequence_parallel.shard_axes(pixel_values.shape[0]))
      return per_shard(self, pixel_values, grid_thw)
    return self.mm_projector(self.vision_tower(pixel_values, grid_thw))

  def __call__(self, tokens: jax.Array, pixel_values: jax.Array | None = None, grid_thw=None,
               positions: jax.Array | None = None, segment_ids: jax.Array | None = None, *,
               return_hidden: bool = False):
    """tokens int32 [batch, seq]; pixel_values [N, 3, p, p] or None (text only) → (logits, aux)."""
    if pixel_values is None:
      if grid_thw is not None:
        raise ValueError("grid_thw was given without pixel_values")
      if not isinstance(tokens, jax.core.Tracer):
        check_media(tokens, None, self.cfg)
      logits, aux = self.language_model(tokens, positions, segment_ids, return_hidden=return_hidden)
      return logits, aux
    if grid_thw is None:
      raise ValueError("pixel_values needs grid_thw: one (t, h, w) per media item")
    if not isinstance(grid_thw, vision.PatchLayout) and not isinstance(tokens, jax.core.Tracer):
      check_media(tokens, grid_thw, self.cfg)
    features = self.encode_media(pixel_values, grid_thw)
    mask = media.placeholder_mask(jnp.asarray(tokens), self.cfg.media_token_ids)
    logits, aux = self.language_model(tokens, positions, segment_ids, return_hidden=return_hidden,
                                      media=(features, mask))
    aux["media_mismatch"] = jnp.sum(mask) != _num_valid_features(grid_thw, features)
    return logits, aux


def _num_valid_features(grid_thw, features: jax.Array):
  """Merged tokens that belong to an item (all of them unless a padded PatchLayout)."""
  if isinstance(grid_thw, vision.PatchLayout):
    return jnp.sum(jnp.asarray(grid_thw.merged_items) > 0)
  return features.shape[0] * (features.shape[1] if features.ndim == 3 else 1)


def _dummy_inputs(cfg: K25Config):
  """One image of one merged token and a prompt holding its placeholder."""
  kh, kw = cfg.vision.merge_kernel_size
  p = cfg.vision.patch_size
  tokens = jnp.array([[0, cfg.image_token_id, 0, 0]], jnp.int32)
  return tokens, jnp.zeros((kh * kw, 3, p, p), jnp.float32), ((1, kh, kw),)


def init_params(cfg: K25Config, rng: jax.Array):
  """Plain (unboxed) parameter pytree of a freshly initialised K25 (one jitted init)."""
  variables = jax.jit(lambda key: K25(cfg).init(key, *_dummy_inputs(cfg)))(rng)
  return nn.meta.unbox(variables["params"])


def abstract_params(cfg: K25Config):
  """Shapes and logical-axis boxes of the params, without allocating (`jax.eval_shape`)."""
  return jax.eval_shape(lambda: K25(cfg).init(jax.random.PRNGKey(0), *_dummy_inputs(cfg)))["params"]


def param_counts_by_part(cfg: K25Config) -> dict[str, int]:
  """Parameter counts per part and in total, from the abstract shapes (no allocation)."""
  params = nn.meta.unbox(abstract_params(cfg))
  counts = {part: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree)) for part, tree in params.items()}
  counts["total"] = sum(counts.values())
  return counts
