"""Training the K2.5 multimodal model: media batches on device, answer metrics, evaluation.

    host batch  = mixture features [B, S] + media items (k25jax.data.mixture)
    device batch = the features; pixel_values zero-padded to a fixed patch budget P and
                   layout = vision.patch_layout(grids, num_patches=P, num_merged=P / (kh·kw)),
                   so ONE compilation serves every batch (a batch without media takes the
                   text-only path, a second one)
    L = CE(K25(tokens, pixel_values, layout)) + z · mean (log Z)² + α · L_balance   (objective.next_token)

The answers of vision samples are scored whole: a sample is `answer_exact` when the argmax
is right at every answer position given the right prefix, which is exactly when greedy
decoding reproduces the answer.

Single process only: media are replicated, and each process would bring its own.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k25jax import losses
from k25jax.data import mixture, vision as vision_data
from k25jax.model import k25, media as media_lib, vision
from k25jax.model.config import K25Config
from k25jax.train import sharding

TEXT_FEATURES = mixture.FEATURES
MEDIA = ("pixel_values", "layout")


def check_single_process(stage: str) -> None:
  if jax.process_count() > 1:
    raise NotImplementedError(f"the {stage} stage runs in one process (media are replicated on every "
                              f"device); got {jax.process_count()} processes")


def device_features(features: dict, cfg: K25Config, max_patches: int) -> dict[str, np.ndarray]:
  """Host arrays of one batch for the jitted step (module docstring). Raises ValueError when
  the placeholders do not number exactly the media's tokens, or the media exceed the budget."""
  out = {name: features[name] for name in TEXT_FEATURES}
  items = features["media"]
  if not items:
    placeholders = int(media_lib.placeholder_mask(out["inputs"], cfg.media_token_ids).sum())
    if placeholders:
      raise ValueError(f"the batch has {placeholders} media placeholder tokens but no media")
    return out
  pixels, grids = vision_data.pack_media(items)
  k25.check_media(out["inputs"], grids, cfg)
  if pixels.shape[0] > max_patches:
    raise ValueError(f"the batch's media have {pixels.shape[0]} patches, more than the budget {max_patches}")
  padded = np.zeros((max_patches,) + pixels.shape[1:], np.float32)
  padded[:pixels.shape[0]] = pixels
  out["pixel_values"] = padded
  out["layout"] = vision.patch_layout(grids, cfg.vision, num_patches=max_patches,
                                      num_merged=max_patches // cfg.vision.merge_size)
  return out


def batch_specs(with_media: bool, names: Sequence[str] = TEXT_FEATURES) -> dict:
  """PartitionSpecs of a device batch: the [batch, seq] features `names` over the batch axes
  and `sequence`, media (pixel_values, layout) replicated."""
  specs = {name: P(sharding.BATCH_AXES, "sequence") for name in names}
  if with_media:
    specs.update({name: P() for name in MEDIA})
  return specs


def to_device(batch: dict, mesh: jax.sharding.Mesh) -> dict:
  """The host batch on `mesh`, laid out by `batch_specs` of its own features."""
  specs = batch_specs("pixel_values" in batch, [name for name in batch if name not in MEDIA])
  return {name: jax.tree.map(lambda x, s=specs[name]: jax.device_put(x, NamedSharding(mesh, s)), value)
          for name, value in batch.items()}


def media_step(with_media, text_only):
  """One step for device batches with media and one for text-only batches (each its own
  compilation), chosen per batch."""
  return lambda state, batch: (with_media if "pixel_values" in batch else text_only)(state, batch)


def answer_metrics(logits: jax.Array, batch: dict) -> dict[str, jax.Array]:
  """answer_exact_count / answer_count over the vision samples of the batch (whole answers)."""
  b, s = batch["targets"].shape
  scored = (batch["loss_mask"] > 0) & (batch["is_vision"] > 0)
  wrong = scored & (losses.first_argmax(logits) != batch["targets"])
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
