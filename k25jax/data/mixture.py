"""Joint vision–text batches: packed rows whose vision share BY TOKENS follows a schedule.

Per batch t of B rows × S positions, every row filled to S (when r_t < 1):

    want_t = r_t · B · S + debt_{t−1}       vision positions this batch should hold
    take vision samples in order while Σ len + ½ · len(next) ≤ want_t and a row is found
    for the next one;  debt_t = want_t − Σ len   (error diffusion: the running share
    stays within half a sample of the target, so a share of 10% holds batch after batch)
    media shards: the rows form D consecutive groups of B/D (one per data shard of the mesh,
    which encodes its own media), each with a patch budget P/D; the next sample goes to the
    shard holding the fewest patches where it fits (budget and a row with room), first-fit
    among that shard's rows (D = 1: plain first-fit under the batch's budget P)
    fill the rest of every row with text: documents [BOS] text [EOS] as (input, target)
    pairs; a document cut at a row's end continues in the next row as a new segment

A vision sample of L tokens takes L − 1 positions (its input/target pairs); "vision share"
is the fraction of a batch's positions taken by vision samples (media blocks, prompts and
answers: the image–text data, as a data-mixture ratio counts it). With r_t = 1 (the ViT
stage) rows hold vision samples only, first-fit, and the rest is padding.

Schedules (`kind`), T = total steps, s = start · T:

    constant: r_t = r · 1[t ≥ s]                    start 0: early fusion; start late: late fusion
    ramp:     r_t = r · clip((t − s) / (T − s), 0, 1)

The whole run's vision share is r·(1 − start) (constant) or r·(1 − start)/2 (ramp):
settings with equal values see the same total vision tokens, e.g. the paper's early 10:90
from step 0, mid 20:80 from 50% and late 50:50 from 80% all give 0.1.

Features (numpy, [B, S]): inputs, targets, positions, segment_ids, loss_mask (as
`pipeline.lm_dataset`), is_vision (1 on positions of vision samples); plus `media`, the
`vision.Media` items in the row-major order of their placeholders (a shard's items are
consecutive), and `shard_patches` [D], the patches each media shard holds. Vision samples put the
loss on their answers (`VisionSample.answer_start`), text on every target.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import grain
import numpy as np

from k25jax.data import pipeline, visual_synthetic
from k25jax.data.tokenizer import Tokenizer

SCHEDULES = ("constant", "ramp")
FEATURES = pipeline.FEATURES + ("is_vision",)


@dataclasses.dataclass(frozen=True)
class VisionSchedule:
  """Vision share by tokens over training (module docstring): ratio r, kind, start fraction."""

  ratio: float
  kind: str = "constant"
  start: float = 0.0

  def __post_init__(self):
    if not 0.0 <= self.ratio <= 1.0:
      raise ValueError(f"data.vision_ratio must lie in [0, 1], got {self.ratio}")
    if self.kind not in SCHEDULES:
      raise ValueError(f"data.vision_schedule={self.kind!r}; choose one of {SCHEDULES}")
    if not 0.0 <= self.start < 1.0:
      raise ValueError(f"data.vision_start must lie in [0, 1), got {self.start}")

  def ratio_at(self, step: int, total_steps: int) -> float:
    begin = self.start * total_steps
    if step < begin:
      return 0.0
    if self.kind == "constant":
      return self.ratio
    return self.ratio * min(1.0, (step - begin) / max(total_steps - begin, 1))

  @property
  def overall_share(self) -> float:
    """The whole run's vision share (for total-steps → ∞ discretisation)."""
    return self.ratio * (1.0 - self.start) * (1.0 if self.kind == "constant" else 0.5)


@dataclasses.dataclass
class Row:
  """One row being filled: (inputs, targets, mask, is_vision) pieces, one segment each."""

  space: int
  pieces: list = dataclasses.field(default_factory=list)
  media: list = dataclasses.field(default_factory=list)

  def add(self, inputs, targets, mask, vision_piece: bool, media=()):
    self.pieces.append((inputs, targets, mask, vision_piece))
    self.media.extend(media)
    self.space -= len(inputs)


def sample_pairs(sample: visual_synthetic.VisionSample):
  """(inputs, targets, loss mask) of a vision sample: the loss on targets from the answer on."""
  tokens = sample.tokens
  mask = (np.arange(1, len(tokens)) >= sample.answer_start).astype(np.float32)
  return tokens[:-1], tokens[1:], mask


def rows_to_features(rows: list[Row], seq_len: int) -> dict[str, np.ndarray]:
  out = {name: np.zeros((len(rows), seq_len), np.float32 if name in ("loss_mask", "is_vision") else np.int32)
         for name in FEATURES}
  for r, row in enumerate(rows):
    at = 0
    for segment, (inputs, targets, mask, vision_piece) in enumerate(row.pieces, start=1):
      n = len(inputs)
      out["inputs"][r, at:at + n] = inputs
      out["targets"][r, at:at + n] = targets
      out["loss_mask"][r, at:at + n] = mask
      out["positions"][r, at:at + n] = np.arange(n)
      out["segment_ids"][r, at:at + n] = segment
      out["is_vision"][r, at:at + n] = float(vision_piece)
      at += n
  return out


class MixtureIterator(grain.DatasetIterator):
  """Endless joint batches (module docstring); `get_state`/`set_state` resume exactly.

  vision_sample(i) -> the i-th `VisionSample` (a pure function of i); text: a grain iterator
  of token arrays ([BOS] … [EOS] documents). Each sample must fit in one row; a batch's media
  hold at most `max_patches` patches (the vision tower's fixed budget: one compilation),
  `max_patches / shards` in each of the `shards` media shards.
  """

  def __init__(self, *, vision_sample: Callable[[int], visual_synthetic.VisionSample],
               text: grain.DatasetIterator | None, schedule: VisionSchedule, batch: int, seq_len: int,
               total_steps: int, max_patches: int, shards: int = 1):
    super().__init__()
    if text is None and schedule.ratio < 1.0:
      raise ValueError(f"data.vision_ratio={schedule.ratio} < 1 needs a text source")
    check_shards(batch, max_patches, shards)
    self.vision_sample, self.text, self.schedule = vision_sample, text, schedule
    self.batch, self.seq_len, self.total_steps, self.max_patches = batch, seq_len, total_steps, max_patches
    self.shards, self.shard_budget = shards, max_patches // shards
    self.step, self.vision_index, self.debt = 0, 0, 0.0
    self.doc, self.doc_pos = np.zeros(0, np.int32), 0
    self.cache: dict[int, visual_synthetic.VisionSample] = {}

  # ------------------------------------------------------------------ vision
  def peek(self) -> visual_synthetic.VisionSample:
    if self.vision_index not in self.cache:
      self.cache = {self.vision_index: self.vision_sample(self.vision_index)}
    sample = self.cache[self.vision_index]
    if len(sample) - 1 > self.seq_len:
      raise ValueError(f"vision sample {self.vision_index} ({sample.task}) has {len(sample) - 1} positions, "
                       f"more than train.seq_len={self.seq_len}")
    if sample.num_patches > self.shard_budget:
      per_shard = f" / {self.shards} media shards" if self.shards > 1 else ""
      raise ValueError(f"vision sample {self.vision_index} ({sample.task}) has {sample.num_patches} patches, "
                       f"more than the budget of {self.shard_budget} (data.max_patches={self.max_patches}"
                       f"{per_shard})")
    return sample

  def find_row(self, rows: list[Row], patches: list[int], sample: visual_synthetic.VisionSample) -> int | None:
    """The row for `sample` (module docstring): the least-loaded shard with room, first-fit in it."""
    per_shard = self.batch // self.shards
    for shard in sorted(range(self.shards), key=lambda s: (patches[s], s)):
      if patches[shard] + sample.num_patches > self.shard_budget:
        continue
      for r in range(shard * per_shard, (shard + 1) * per_shard):
        if rows[r].space >= len(sample) - 1:
          return r
    return None

  def place_vision(self, rows: list[Row], ratio: float) -> list[int]:
    """Places this batch's vision samples; returns the patches of each media shard."""
    only_vision = ratio >= 1.0
    want = self.batch * self.seq_len if only_vision else ratio * self.batch * self.seq_len + self.debt
    taken, patches, per_shard = 0, [0] * self.shards, self.batch // self.shards
    while True:
      sample = self.peek()
      n = len(sample) - 1
      if not only_vision and taken + n / 2 > want:
        break
      r = self.find_row(rows, patches, sample)
      if r is None:
        break
      rows[r].add(*sample_pairs(sample), True, sample.media)
      taken += n
      patches[r // per_shard] += sample.num_patches
      self.vision_index += 1
    self.debt = 0.0 if only_vision or ratio == 0.0 else want - taken
    return patches

  # ------------------------------------------------------------------ text
  def fill_text(self, row: Row) -> None:
    while row.space > 0:
      if self.doc_pos >= len(self.doc) - 1:
        self.doc, self.doc_pos = np.asarray(next(self.text), np.int32), 0
        continue
      n = min(row.space, len(self.doc) - 1 - self.doc_pos)
      piece = self.doc[self.doc_pos:self.doc_pos + n + 1]
      row.add(piece[:-1], piece[1:], np.ones(n, np.float32), False)
      self.doc_pos += n

  # ------------------------------------------------------------------ iterator
  def __next__(self) -> dict:
    ratio = self.schedule.ratio_at(self.step, self.total_steps)
    rows = [Row(self.seq_len) for _ in range(self.batch)]
    patches = self.place_vision(rows, ratio) if ratio > 0.0 else [0] * self.shards
    if ratio < 1.0:
      for row in rows:
        self.fill_text(row)
    self.step += 1
    features = rows_to_features(rows, self.seq_len)
    features["media"] = [m for row in rows for m in row.media]
    features["shard_patches"] = np.asarray(patches, np.int32)
    return features

  def get_state(self) -> dict:
    return {"step": self.step, "vision_index": self.vision_index, "debt": self.debt,
            "doc": self.doc.tolist(), "doc_pos": self.doc_pos,
            "text": None if self.text is None else self.text.get_state()}

  def set_state(self, state: dict) -> None:
    self.step, self.vision_index, self.debt = int(state["step"]), int(state["vision_index"]), float(state["debt"])
    self.doc, self.doc_pos = np.asarray(state["doc"], np.int32), int(state["doc_pos"])
    if self.text is not None:
      self.text.set_state(state["text"])


def check_shards(batch: int, max_patches: int, shards: int) -> None:
  """Raises ValueError unless `shards` media shards split the rows and the patch budget evenly."""
  if shards < 1 or batch % shards or max_patches % shards:
    raise ValueError(f"{shards} media shards (one per data shard of the mesh) must divide train.batch={batch} "
                     f"and data.max_patches={max_patches}")


def patch_imbalance(shard_patches: np.ndarray) -> float:
  """max_s patches_s / mean_s patches_s of one batch (1 = balanced; 0 patches: 1): the factor
  by which the busiest shard's vision tower outlasts an even split."""
  shard_patches = np.asarray(shard_patches, np.float64)
  mean = shard_patches.mean()
  return float(shard_patches.max() / mean) if mean > 0 else 1.0


def text_documents(docs: list[str], tok: Tokenizer, *, seed: int, shuffle: bool = True, shard_index: int = 0,
                   shard_count: int = 1) -> grain.DatasetIterator:
  """An endless grain iterator of tokenized documents ([BOS] + text + [EOS])."""
  ds = grain.MapDataset.source(docs)[shard_index::shard_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  return iter(ds.repeat(None).map(pipeline.tokenize_fn(tok)).to_iter_dataset())


def mixture(*, docs: list[str] | None, tok: Tokenizer, schedule: VisionSchedule, tasks, batch: int,
            seq_len: int, total_steps: int, seed: int, max_patches: int, shuffle: bool = True,
            shards: int = 1, vision_sample: Callable[[int], visual_synthetic.VisionSample] | None = None
            ) -> MixtureIterator:
  """Vision samples — synthetic ones of `tasks` (stream `seed`), or `vision_sample(i)` (e.g. the
  user's image-text pairs, `image_text.sampler`) — mixed with `docs` by `schedule`, the rows in
  `shards` media shards."""
  if vision_sample is None:
    tasks = visual_synthetic.check_tasks(tasks)
    vision_sample = lambda i: visual_synthetic.sample(i, seed, tok, tasks)
  text = None if docs is None else text_documents(docs, tok, seed=seed, shuffle=shuffle)
  return MixtureIterator(vision_sample=vision_sample, text=text,
                         schedule=schedule, batch=batch, seq_len=seq_len, total_steps=total_steps,
                         max_patches=max_patches, shards=shards)


def vision_share(batches: Iterator[dict], n: int) -> float:
  """Fraction of the positions of `n` batches taken by vision samples."""
  vision = total = 0.0
  for _ in range(n):
    b = next(batches)
    vision += float(b["is_vision"].sum())
    total += b["is_vision"].size
  return vision / total
