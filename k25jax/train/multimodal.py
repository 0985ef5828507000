"""Training the K2.5 multimodal model: media batches on device, answer metrics, evaluation.

    host batch  = mixture features [B, S] + media items (k25jax.data.mixture)
    device batch = the features; pixel_values zero-padded to a fixed patch budget P and
                   layout = vision.patch_layout(grids, num_patches=P, num_merged=P / (kh·kw)),
                   so ONE compilation serves every batch (a batch without media takes the
                   text-only path, a second one)
    media shards D > 1 (`data.shard_media`: one per data shard of the mesh): rows split into
                   D consecutive groups, pixel_values [D, P/D, 3, p, p] and a layout per group
                   stacked [D, ...], split over the batch axes with the rows, so each data
                   shard encodes only its own rows' media (`k25.K25` splices per shard)
    L = CE(K25(tokens, pixel_values, layout)) + z · mean (log Z)² + α · L_balance   (objective.next_token)

The answers of vision samples are scored whole: a sample is `answer_exact` when the argmax
is right at every answer position given the right prefix, which is exactly when greedy
decoding reproduces the answer.

Several processes: every process builds the same global host batch (the mixture is a
pure function of its seed) and puts only its devices' shards on them (`to_device`).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k25jax.data import mixture, vision as vision_data
from k25jax.model import k25, media as media_lib, vision
from k25jax.model.config import K25Config
from k25jax.train import sharding

TEXT_FEATURES = mixture.FEATURES
MEDIA = ("pixel_values", "layout")


def media_shards(config, mesh: jax.sharding.Mesh) -> int:
  """D: the data shards of `mesh` when `data.shard_media`, else 1 (media replicated)."""
  return sharding.batch_shards(mesh) if config.data.get("shard_media", False) else 1


def padded_media(items: Sequence, cfg: K25Config, max_patches: int) -> tuple[np.ndarray, vision.PatchLayout]:
  """(pixel_values [P, 3, p, p], layout) of `items` zero-padded to the budget P = max_patches."""
  pixels, grids = vision_data.pack_media(items) if items else (np.zeros((0, 3, cfg.vision.patch_size,
                                                                          cfg.vision.patch_size), np.float32), ())
  if pixels.shape[0] > max_patches:
    raise ValueError(f"the batch's media have {pixels.shape[0]} patches, more than the budget {max_patches}")
  padded = np.zeros((max_patches,) + pixels.shape[1:], np.float32)
  padded[:pixels.shape[0]] = pixels
  return padded, vision.patch_layout(grids, cfg.vision, num_patches=max_patches,
                                     num_merged=max_patches // cfg.vision.merge_size)


def split_items(items: Sequence, tokens_per_item: Sequence[int], placeholders_per_shard: np.ndarray) -> list[list]:
  """The consecutive runs of `items` whose tokens fill each shard's placeholders (items are in
  row-major placeholder order, so a shard's items are consecutive). Raises ValueError when an
  item would straddle two shards."""
  out, start = [], 0
  for shard, need in enumerate(placeholders_per_shard):
    stop, have = start, 0
    while have < need:
      have += tokens_per_item[stop]
      stop += 1
    if have != need:
      raise ValueError(f"media shard {shard}'s rows hold {int(need)} placeholders, which do not end on an item")
    out.append(list(items[start:stop]))
    start = stop
  return out


def device_features(features: dict, cfg: K25Config, max_patches: int, shards: int = 1) -> dict[str, np.ndarray]:
  """Host arrays of one batch for the jitted step (module docstring), the media in `shards`
  shards of max_patches / shards patches. Raises ValueError when the placeholders do not number
  exactly the media's tokens, or the media exceed the budget."""
  out = {name: features[name] for name in TEXT_FEATURES}
  items = features["media"]
  if not items:
    placeholders = int(media_lib.placeholder_mask(out["inputs"], cfg.media_token_ids).sum())
    if placeholders:
      raise ValueError(f"the batch has {placeholders} media placeholder tokens but no media")
    return out
  grids = [m.grid_thw for m in items]
  k25.check_media(out["inputs"], grids, cfg)
  if shards == 1:
    out["pixel_values"], out["layout"] = padded_media(items, cfg, max_patches)
    return out
  rows = out["inputs"].shape[0]
  if rows % shards or max_patches % shards:
    raise ValueError(f"{shards} media shards must divide the batch's {rows} rows and the budget {max_patches}")
  mask = media_lib.placeholder_mask(out["inputs"], cfg.media_token_ids)
  per_shard = mask.reshape(shards, -1).sum(axis=1)
  tokens = [vision.num_media_tokens(g, cfg.vision.merge_kernel_size) for g in grids]
  parts = [padded_media(group, cfg, max_patches // shards) for group in split_items(items, tokens, per_shard)]
  out["pixel_values"] = np.stack([pixels for pixels, _ in parts])
  out["layout"] = jax.tree.map(lambda *xs: np.stack(xs), *[layout for _, layout in parts])
  return out


def batch_specs(with_media: bool, names: Sequence[str] = TEXT_FEATURES, sharded_media: bool = False) -> dict:
  """PartitionSpecs of a device batch: the [batch, seq] features `names` over the batch axes
  and `sequence`; media (pixel_values, layout) replicated, or their leading media-shard axis
  over the batch axes (`sharded_media`)."""
  specs = {name: P(sharding.BATCH_AXES, "sequence") for name in names}
  if with_media:
    specs.update({name: P(sharding.BATCH_AXES) if sharded_media else P() for name in MEDIA})
  return specs


def is_sharded(batch: dict) -> bool:
  """Whether a host or device batch carries its media in shards ([D, P/D, 3, p, p] pixels)."""
  return "pixel_values" in batch and batch["pixel_values"].ndim == 5


def to_device(batch: dict, mesh: jax.sharding.Mesh) -> dict:
  """The global host batch on `mesh`, laid out by `batch_specs` of its own features; with
  several processes each puts only the shards of its own devices."""
  specs = batch_specs("pixel_values" in batch, [name for name in batch if name not in MEDIA], is_sharded(batch))
  return {name: sharding.from_host(value, NamedSharding(mesh, specs[name])) for name, value in batch.items()}


def media_step(with_media, text_only):
  """One step for device batches with media and one for text-only batches (each its own
  compilation), chosen per batch."""
  return lambda state, batch: (with_media if "pixel_values" in batch else text_only)(state, batch)


def answer_metrics(hits: jax.Array, batch: dict) -> dict[str, jax.Array]:
  """answer_exact_count / answer_count over the vision samples of the batch (whole answers);
  hits [batch, seq]: whether each position's argmax is its target."""
  b, s = batch["targets"].shape
  scored = (batch["loss_mask"] > 0) & (batch["is_vision"] > 0)
  wrong = scored & ~hits
  ids = (jnp.arange(b)[:, None] * (s + 1) + batch["segment_ids"]).reshape(-1)
  seg_wrong = jax.ops.segment_max(wrong.reshape(-1).astype(jnp.int32), ids, num_segments=b * (s + 1))
  seg_scored = jax.ops.segment_max(scored.reshape(-1).astype(jnp.int32), ids, num_segments=b * (s + 1))
  seg_scored, seg_wrong = jnp.maximum(seg_scored, 0), jnp.maximum(seg_wrong, 0)
  return {"answer_exact_count": jnp.sum(seg_scored * (1 - seg_wrong)).astype(jnp.float32),
          "answer_count": jnp.sum(seg_scored).astype(jnp.float32)}


def evaluate(eval_step, state, batches: list[dict]) -> dict[str, float]:
  """Token-weighted loss and accuracy, and answer_exact = Σ exact / Σ answers, over `batches`."""
  totals, tokens = {}, 0.0
  for batch in batches:
    m = {k: float(v) for k, v in jax.device_get(eval_step(state, batch)).items()}
    tokens += m["tokens"]
    for name in ("loss", "cross_entropy", "accuracy"):
      totals[name] = totals.get(name, 0.0) + m[name] * m["tokens"]
    for name in ("answer_exact_count", "answer_count"):
      totals[name] = totals.get(name, 0.0) + m[name]
  out = {name: totals[name] / max(tokens, 1.0) for name in ("loss", "cross_entropy", "accuracy")}
  if totals["answer_count"]:
    out["answer_exact"] = totals["answer_exact_count"] / totals["answer_count"]
  out["tokens"] = tokens
  return out
