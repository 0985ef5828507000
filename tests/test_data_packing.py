"""Packing fixed sequences into rows: every sequence lands whole in one row, as its own segment, nothing lost."""
import numpy as np

from k25jax.data import packing


def _sequences():
  rng = np.random.default_rng(0)
  lengths = np.array([9, 3, 5, 9, 2, 6, 4])
  tokens = np.zeros((7, 10), np.int32)
  weights = np.zeros((7, 10), np.float32)
  for i, n in enumerate(lengths):
    tokens[i, :n] = rng.integers(1, 50, n)
    weights[i, 1:n] = rng.integers(0, 2, n - 1)
  return tokens, weights, lengths


def test_pack_keeps_every_sequence_as_a_segment():
  tokens, weights, lengths = _sequences()
  packed = packing.pack(tokens, weights, lengths)
  assert len(packed["inputs"]) < len(tokens)
  found = 0
  for r in range(len(packed["inputs"])):
    seg = packed["segment_ids"][r]
    for s in range(1, seg.max() + 1):
      at = np.flatnonzero(seg == s)
      n = len(at) + 1
      matches = [i for i in range(len(tokens)) if lengths[i] == n
                 and np.array_equal(tokens[i, :n - 1], packed["inputs"][r, at])
                 and np.array_equal(tokens[i, 1:n], packed["targets"][r, at])
                 and np.array_equal(weights[i, 1:n], packed["loss_mask"][r, at])]
      assert matches, (r, s)
      np.testing.assert_array_equal(packed["positions"][r, at], np.arange(n - 1))
      found += 1
  assert found == len(tokens)
  assert packed["loss_mask"].sum() == weights[:, 1:].sum()
  assert np.all(packed["loss_mask"][packed["segment_ids"] == 0] == 0)


def test_unshared_rows_hold_one_sequence_each():
  tokens, weights, lengths = _sequences()
  packed = packing.pack(tokens, weights, lengths, share_rows=False)
  assert len(packed["inputs"]) == len(tokens)
  assert packed["segment_ids"].max() == 1
