"""Media placeholders in the token stream: counting them, checking them, splicing features in.

A K2.5 prompt carries each media item as `<|media_begin|>image<|media_content|>` +
N × placeholder + `<|media_end|>`, N = `vision.num_media_tokens(grid)`. The projector's
output rows replace the placeholder embeddings IN ORDER: the j-th placeholder of the batch
(row-major over [batch, seq]) takes feature row j. Positions stay 1-D.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def placeholder_mask(tokens, media_token_ids: Sequence[int]):
  """bool [batch, seq]: where tokens is one of the placeholder ids (numpy in, numpy out)."""
  xp = np if isinstance(tokens, np.ndarray) else jnp
  return xp.isin(tokens, xp.asarray(list(media_token_ids), dtype=tokens.dtype))


def check_counts(num_placeholders: int, items_tokens: Sequence[int]) -> None:
  """Raises ValueError unless the placeholders number exactly Σ items_tokens (0 for no items)."""
  expected = int(sum(items_tokens))
  if int(num_placeholders) != expected:
    per_item = ", ".join(str(int(n)) for n in items_tokens)
    raise ValueError(f"the prompt has {int(num_placeholders)} media placeholder tokens but its media "
                     f"need {expected} ({len(items_tokens)} items: {per_item}); every item needs "
                     "exactly h·w/4 placeholders, in the order of grid_thw")


def check_placeholders(mask: np.ndarray, items_tokens: Sequence[int]) -> None:
  """Raises ValueError unless the placeholders match the media, item by item.

  mask: bool [batch, seq] (numpy). The placeholders must number exactly Σ items_tokens, and
  every run of consecutive placeholders in a row must hold whole items, in order (a run may
  hold several adjacent items, never part of one).
  """
  mask = np.asarray(mask, bool).reshape(-1, np.shape(mask)[-1])
  check_counts(int(mask.sum()), items_tokens)
  per_item = ", ".join(str(int(n)) for n in items_tokens)
  item = 0
  for row, line in enumerate(mask):
    edges = np.flatnonzero(np.diff(np.concatenate([[0], line.astype(np.int8), [0]])))
    for start, stop in zip(edges[::2], edges[1::2]):
      need, first = 0, item
      while need < stop - start:
        need += int(items_tokens[item])
        item += 1
      if need != stop - start:
        raise ValueError(f"the {stop - start} media placeholders at row {row}, columns {start}..{stop - 1} "
                         f"do not hold whole items: items {first}..{item - 1} need {need} ({per_item})")


def splice(h: jax.Array, features: jax.Array, mask: jax.Array) -> jax.Array:
  """h with the j-th masked position (row-major) replaced by features[j].

  h: [batch, seq, d]; features: [n, d], or [D, n, d] for media in D shards (the rows split
  into D consecutive groups; group g's j-th placeholder takes features[g, j]); mask: bool
  [batch, seq]. Traced, so a count mismatch cannot raise here (callers check on the host
  first: `k25.check_media`): placeholders past row n − 1 get zeros, feature rows past the
  last placeholder are unused. Within a group, index = (placeholders of the earlier rows) +
  (placeholders before it in its row), so a row split along the sequence stays split.
  """
  shards = features.shape[0] if features.ndim == 3 else 1
  b, s, d = h.shape
  grouped = lambda x: x.reshape((shards, b // shards) + x.shape[1:])
  per_shard = features.reshape((shards,) + features.shape[-2:])
  mask = grouped(mask).astype(jnp.int32)
  in_row = jnp.cumsum(mask, axis=-1)
  index = in_row - 1 + (jnp.cumsum(in_row[..., -1], axis=-1) - in_row[..., -1])[..., None]
  gathered = jax.vmap(lambda f, i: jnp.take(f, i, axis=0, mode="fill", fill_value=0))(per_shard, index)
  out = jnp.where(mask[..., None] > 0, gathered.astype(h.dtype), grouped(h))
  return out.reshape(b, s, d)
