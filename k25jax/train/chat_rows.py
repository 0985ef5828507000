"""Rendered chats (`k25jax.data.chat_files`) as the batches of the SFT step.

    rows      packing.assign over rows of L − 1 positions (L = data.max_length): best fit,
              longest first; chats with images pack among themselves, so an image row's
              media are its chats' images in segment order
    step t    `batch` rows of chats without images and `visual_batch` rows of chats with
              images, drawn without replacement by a generator seeded by (seed, t), the
              images' pixel values zero-padded to visual_batch × the most patches any image
              row holds (one compilation for every step)
    held out  every held-out row once, in batches of those same shapes (the last one
              filled with empty rows, which carry no loss)

The parts with no chats are absent: text-only files give text-only batches (the text-only
step), files of image chats alone give batches of image rows only.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from k25jax.data import chat_files, files, packing
from k25jax.model.config import K25Config
from k25jax.train import multimodal


class _Part:
  """The packed rows of one kind of chat and, for image chats, each row's media."""

  def __init__(self, chats: Sequence[chat_files.Chat], length: int, pad_id: int):
    data = packing.right_padded([(c.ids, c.loss_mask) for c in chats], length, pad_id)
    members = packing.assign(data["length"], length - 1)
    self.rows = packing.pack(data["tokens"], data["loss_mask"], data["length"], rows=members)
    self.media = [[m for i in row for m in chats[i].images] for row in members]
    self.patches = max((sum(m.pixel_values.shape[0] for m in media) for media in self.media), default=0)

  def __len__(self) -> int:
    return len(self.media)

  def take(self, rows: Sequence[int | None]) -> tuple[dict[str, np.ndarray], list]:
    """The features of `rows` (None: an empty row) and their media, in row order."""
    empty = {name: np.zeros_like(v[:1]) for name, v in self.rows.items()}
    features = {name: np.concatenate([v[r:r + 1] if r is not None else empty[name] for r in rows])
                for name, v in self.rows.items()}
    return features, [m for r in rows if r is not None for m in self.media[r]]


class ChatRows:
  """Training batches by step (`__call__`) and the held-out batches (`held_out`), module docstring."""

  def __init__(self, chats: Sequence[chat_files.Chat], held_out: Sequence[chat_files.Chat], *, length: int,
               batch: int, visual_batch: int, pad_id: int, cfg: K25Config, seed: int):
    self.cfg, self.seed, self.length = cfg, seed, length
    self.sizes = {"text": batch, "image": visual_batch}
    self.train = self._parts(chats, length, pad_id)
    for kind, part in self.train.items():
      if len(part) < self.sizes[kind]:
        field = "train.batch" if kind == "text" else "train.visual_batch"
        raise files.BadData(f"data.files: the chats {'with' if kind == 'image' else 'without'} images pack into "
                            f"{len(part)} rows of {length - 1} positions, fewer than {field}={self.sizes[kind]}")
    self.eval = self._parts(held_out, length, pad_id)
    if set(self.eval) - set(self.train):
      raise files.BadData("data.eval_files: held-out chats with images, but no training chat has one (or the "
                          "reverse): the held-out batches must take the training step's shapes")
    self.patches = max((p.patches for parts in (self.train, self.eval) for p in parts.values()), default=0)

  @staticmethod
  def _parts(chats: Sequence[chat_files.Chat], length: int, pad_id: int) -> dict[str, _Part]:
    groups = {"text": [c for c in chats if not c.images], "image": [c for c in chats if c.images]}
    return {kind: _Part(group, length, pad_id) for kind, group in groups.items() if group}

  @property
  def with_media(self) -> bool:
    return "image" in self.train

  @property
  def width(self) -> int:
    """Positions of a row."""
    return self.length - 1

  @property
  def rows_per_step(self) -> int:
    return sum(self.sizes[kind] for kind in self.train)

  def _batch(self, picks: dict[str, Sequence[int | None]], parts: dict[str, _Part]) -> dict:
    features, media = [], []
    for kind in self.train:
      f, m = parts[kind].take(picks[kind]) if kind in parts else self.train[kind].take([None] * self.sizes[kind])
      features.append(f)
      media += m
    out = {name: np.concatenate([f[name] for f in features]) for name in features[0]}
    if self.with_media:
      out["pixel_values"], out["layout"] = multimodal.padded_media(media, self.cfg,
                                                                   self.sizes["image"] * self.patches)
    return out

  def __call__(self, step: int) -> dict:
    rng = packing.step_rng(self.seed, step)
    picks = {kind: packing.draw_rows(rng, len(part), self.sizes[kind]) for kind, part in self.train.items()}
    return self._batch(picks, self.train)

  def held_out(self) -> list[dict]:
    """Every held-out row once, in batches of the training step's shapes ([] without held-out chats)."""
    if not self.eval:
      return []
    count = max(-(-len(part) // self.sizes[kind]) for kind, part in self.eval.items())
    out = []
    for b in range(count):
      picks = {}
      for kind, size in self.sizes.items():
        have = len(self.eval[kind]) if kind in self.eval else 0
        picks[kind] = [r if r < have else None for r in range(b * size, (b + 1) * size)]
      out.append(self._batch(picks, self.eval))
    return out
