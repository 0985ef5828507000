"""The images of a batch's rows for the K2.5 model: packed for the vision tower, encoded, and
handed to the sampler (`decode.decode`'s media_for) or to an update step.

A row holds at most one image (None: a text-only row). `media_batch` packs the rows' patches,
zero-padded to rows × per_row (one compilation per row count); `rows_media` checks each row's
placeholders against its image and encodes the batch on the params' mesh.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from k25jax.data import vision as vision_data
from k25jax.model import k25, media as media_lib, vision
from k25jax.model.config import K25Config
from k25jax.rl import decode, sampler


def media_batch(items: Sequence[vision_data.Media | None], cfg: K25Config, rows: int, per_row: int | None = None
                ) -> tuple[np.ndarray, vision.PatchLayout] | None:
  """Pixel values of `items` (one per row, in row order; None for a row without an image)
  zero-padded to `rows` × `per_row` patches (default: the largest item's), and their
  PatchLayout padded alike (one compilation per row count). None when no row has an image."""
  present = [m for m in items if m is not None]
  if not present:
    return None
  pixels, grids = vision_data.pack_media(present)
  per_row = per_row if per_row is not None else max(m.pixel_values.shape[0] for m in present)
  budget = rows * per_row
  if len(pixels) > budget:
    raise ValueError(f"the rows' images have {len(pixels)} patches, more than {rows} rows x {per_row}")
  padded = np.zeros((budget,) + pixels.shape[1:], np.float32)
  padded[:len(pixels)] = pixels
  kh, kw = cfg.vision.merge_kernel_size
  return padded, vision.patch_layout(grids, cfg.vision, num_patches=budget, num_merged=budget // (kh * kw))


@functools.partial(jax.jit, static_argnames=("cfg",))
def encode_media(params, pixel_values, layout: vision.PatchLayout, *, cfg: K25Config) -> jax.Array:
  """The projector outputs of a padded media batch [num_merged, text hidden] (`K25.encode_media`)."""
  return k25.K25(cfg).apply({"params": params}, pixel_values, layout, method=k25.K25.encode_media)


def rows_media(cfg: K25Config, params, items: Sequence[vision_data.Media | None],
               per_row: int | None = None) -> decode.MediaFor:
  """media_for(prompts) of `decode.decode` for rows whose images are `items` (row order; None:
  no image): the placeholders checked against the items, the images encoded by the vision
  tower (`per_row` patches a row, `media_batch`) into the features the sampler splices in at
  prefill; None when no row has an image."""
  def media_for(prompts):
    mask = media_lib.placeholder_mask(prompts, cfg.media_token_ids)
    media_lib.check_placeholders(mask, [m.num_tokens for m in items if m is not None])
    batch = media_batch(items, cfg, len(prompts), per_row)
    if batch is None:
      return None
    pixel_values, layout = sampler.on_params_mesh(params, batch)
    return encode_media(params, pixel_values, layout, cfg=cfg), mask
  return media_for
