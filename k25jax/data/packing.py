"""Fixed sets of token sequences as packed next-token rows, and the rows of each step.

Sequences (right-padded [n, L] with their lengths and per-token loss weights) are packed
best fit, longest first, into rows of L − 1 positions: each row holds several sequences
as segments 1..k, positions restarting at 0, so short contexts do not pay for padding.
Sequence i contributes inputs x_i[:-1], targets x_i[1:] and weights w_i[1:]: a position
is an input exactly when its target belongs to the same sequence.

The rows of step t are drawn without replacement by a generator seeded by (seed, t), so
a batch depends only on the step and a resumed run sees exactly the same data.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

FEATURES = (("inputs", np.int32), ("targets", np.int32), ("loss_mask", np.float32), ("positions", np.int32),
            ("segment_ids", np.int32))


def right_padded(sequences: Sequence[tuple[Sequence[int], Sequence[float]]], width: int, pad_id: int
                 ) -> dict[str, np.ndarray]:
  """(ids, loss mask) sequences as `pack` takes them: tokens int32 [n, width] (right-padded with
  `pad_id`), loss_mask float32 [n, width] (0 on padding) and length int32 [n]."""
  tokens = np.full((len(sequences), width), pad_id, np.int32)
  mask = np.zeros((len(sequences), width), np.float32)
  for row, (ids, weights) in enumerate(sequences):
    tokens[row, :len(ids)], mask[row, :len(ids)] = ids, weights
  return {"tokens": tokens, "loss_mask": mask, "length": np.array([len(ids) for ids, _ in sequences], np.int32)}


def assign(lengths: np.ndarray, width: int, share_rows: bool = True) -> list[list[int]]:
  """The sequences of each packed row (module docstring), in segment order: best fit, longest
  first, into rows of `width` positions (a sequence of length n takes n − 1)."""
  rows: list[list[int]] = []
  by_room: list[list[int]] = [[] for _ in range(width + 1)]   # rows by their free positions
  for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
    need = int(lengths[i]) - 1
    fits = next((f for f in range(need, width + 1) if by_room[f]), None) if share_rows else None
    if fits is None:                       # best fit: the row with the least room that suffices
      rows.append([i])
      by_room[width - need].append(len(rows) - 1)
    else:
      r = by_room[fits].pop()
      rows[r].append(i)
      by_room[fits - need].append(r)
  return rows


def pack(tokens: np.ndarray, weights: np.ndarray, lengths: np.ndarray, share_rows: bool = True,
         rows: list[list[int]] | None = None) -> dict[str, np.ndarray]:
  """Right-padded sequences [n, L] → packed next-token rows [rows, L − 1] (module docstring):
  inputs, targets, loss_mask, positions and segment_ids (1..k, 0 = padding). With
  share_rows=False every sequence gets a row of its own; `rows` (from `assign`) gives the
  packing instead."""
  width = tokens.shape[1] - 1
  rows = assign(lengths, width, share_rows) if rows is None else rows
  out = {name: np.zeros((len(rows), width), dtype) for name, dtype in FEATURES}
  for r, members in enumerate(rows):
    at = 0
    for segment, i in enumerate(members, start=1):
      put_segment(out, r, at, segment, tokens[i], weights[i], int(lengths[i]))
      at += int(lengths[i]) - 1
  return out


def put_segment(rows: dict[str, np.ndarray], row: int, at: int, segment: int, tokens: np.ndarray,
                weights: np.ndarray, length: int) -> None:
  """Writes one sequence of `length` tokens into `rows[row]` from position `at` as `segment`."""
  n = length - 1
  rows["inputs"][row, at:at + n] = tokens[:n]
  rows["targets"][row, at:at + n] = tokens[1:n + 1]
  rows["loss_mask"][row, at:at + n] = weights[1:n + 1]
  rows["positions"][row, at:at + n] = np.arange(n)
  rows["segment_ids"][row, at:at + n] = segment


def step_rng(seed: int, step: int) -> np.random.Generator:
  """The generator that draws the rows of step `step`."""
  return np.random.default_rng([seed, step])


def draw_rows(rng: np.random.Generator, n_rows: int, batch: int) -> np.ndarray:
  """The sorted indices of `batch` of the `n_rows` rows, drawn without replacement."""
  if batch > n_rows:
    raise ValueError(f"a batch of {batch} rows exceeds the {n_rows} packed rows")
  return np.sort(rng.choice(n_rows, batch, replace=False))
