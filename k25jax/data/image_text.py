"""Image–text pairs from the user's files, for the ViT and joint stages: `data.vision_source=files`.

    data.vision_files = "GLOB,GLOB,..."    JSON lines {"image": PATH, "text": CAPTION[, "prompt": TEXT]}

PATH is relative to the file that names it (or absolute). A pair is a vision sample as the
synthetic tasks' are (`visual_synthetic.VisionSample`):

    tokens = [BOS] + the image's media tokens + encode(prompt) + encode(caption) + [EOS]

with the loss on the caption and EOS, the image through MoonViT-3D's preprocessing
(`vision.preprocess_image`) scaled to at most `max_patches` patches (the batch's budget, or
a media shard's). The stream is endless and a pure function of the sample's index, as the
mixture's resume needs: sample i is pair perm_e[i mod n] of epoch e = i // n, perm_e a
permutation drawn from (seed, e). Every `data.eval_every`-th pair is held out.

A line that is not JSON, a record without `image` or `text` (or with non-text values) and an
image file that does not exist stop the run when the files are read; an image that does not
decode when it is drawn. Each is `files.BadData`, one line naming the file and line (exit 2).
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from k25jax.data import files, vision
from k25jax.data.tokenizer import Tokenizer
from k25jax.data.visual_synthetic import VisionSample

VISION_SOURCES = ("synthetic", "files")


@dataclasses.dataclass(frozen=True)
class Pair:
  image: str        # the image file's path
  text: str         # the caption: what the loss is on
  prompt: str       # text between the image and the caption ('' by default)
  where: str        # FILE:LINE, for errors


def _pair(path: str, number: int, line: str) -> Pair:
  where = f"{path}:{number}"
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise files.BadData(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
  if not (isinstance(record, dict) and isinstance(record.get("image"), str) and isinstance(record.get("text"), str)):
    raise files.BadData(f"{where}: an image-text pair is a JSON object with text fields 'image' (a path) and 'text'")
  prompt = record.get("prompt", "")
  if not isinstance(prompt, str):
    raise files.BadData(f"{where}: 'prompt' is {type(prompt).__name__}, not text")
  image = os.path.join(os.path.dirname(os.path.abspath(path)), os.path.expanduser(record["image"]))
  if not os.path.isfile(image):
    raise files.BadData(f"{where}: image {record['image']!r} does not exist ({image})")
  return Pair(image, record["text"], prompt, where)


def read(path: str) -> list[Pair]:
  """The pairs of one JSON-lines file, in order."""
  try:
    with open(path, encoding="utf-8") as f:
      return [_pair(path, number, line) for number, line in enumerate(f, start=1) if line.strip()]
  except (OSError, UnicodeDecodeError) as e:
    raise files.BadData(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def load(data) -> tuple[list[Pair], list[Pair]]:
  """(training pairs, held-out pairs) of `data.vision_files`."""
  pairs = []
  for pattern, _ in files.parse(data.vision_files, "data.vision_files", weights=False):
    for path in files.matching(pattern, "data.vision_files"):
      if not path.endswith(".jsonl"):
        raise files.BadData(f"{path}: image-text pairs are JSON lines (.jsonl), from data.vision_files={pattern!r}")
      pairs.extend(read(path))
  train = [p for k, p in enumerate(pairs) if k % data.eval_every]
  if not train:
    raise files.BadData(f"data.vision_files={data.vision_files!r}: no training pair is left after holding out "
                        f"every data.eval_every={data.eval_every}-th of its {len(pairs)}")
  return train, pairs[::data.eval_every]


def to_sample(pair: Pair, tok: Tokenizer, max_patches: int) -> VisionSample:
  """The module docstring's sample of one pair."""
  try:
    media = vision.preprocess_image(pair.image, max_patches=min(max_patches, vision.IMAGE_MAX_PATCHES))
  except ValueError as e:
    raise files.BadData(f"{pair.where}: {e}") from None
  head = [tok.bos_id, *vision.media_token_ids(media, tok), *tok.encode(pair.prompt)]
  tokens = np.asarray(head + tok.encode(pair.text) + [tok.eos_id], np.int32)
  return VisionSample(tokens, len(head), (media,), "pair")


def sampler(pairs: list[Pair], tok: Tokenizer, *, seed: int, max_patches: int, shuffle: bool = True):
  """sample(i): the i-th sample of the endless stream over `pairs` (module docstring)."""
  n, orders = len(pairs), {}

  def order(epoch: int) -> np.ndarray:
    if epoch not in orders:
      orders.clear()
      orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    return orders[epoch]

  def sample(i: int) -> VisionSample:
    epoch, k = divmod(i, n)
    return to_sample(pairs[int(order(epoch)[k])], tok, max_patches)
  return sample


def vision_samples(config, tok: Tokenizer, shards: int = 1):
  """(training, held-out) `vision_sample` functions for the mixture: the user's pairs with
  `data.vision_source=files` (the held-out ones in their order), else (None, None): the
  mixture draws the synthetic tasks."""
  data = config.data
  if data.get("vision_source", "synthetic") != "files":
    return None, None
  train, held_out = load(data)
  budget = data.max_patches // shards
  return (sampler(train, tok, seed=config.train.seed, max_patches=budget),
          sampler(held_out, tok, seed=config.train.seed + 1, max_patches=budget, shuffle=False))


def check(data) -> None:
  """One-line errors of `data.vision_source` / `data.vision_files`, before anything is read."""
  source = data.get("vision_source", "synthetic")
  if source not in VISION_SOURCES:
    raise ValueError(f"config: data.vision_source={source!r}: must be one of {VISION_SOURCES}")
  if source == "files":
    files.parse(data.vision_files, "data.vision_files", weights=False)
