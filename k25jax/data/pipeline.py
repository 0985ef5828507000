"""Grain pipelines for language modelling: tokenize, chunk, pack, batch.

    document → [BOS] + encode(text) + [EOS]
             → chunks c of ≤ seq_len + 1 tokens (consecutive chunks overlap by one token)
             → (inputs, targets) = (c[:-1], c[1:])
             → first-fit packed into rows of seq_len
             → {inputs, targets, positions, segment_ids, loss_mask}  [batch, seq_len]

`segment_ids` number the documents of a row 1..n with 0 = padding, `positions`
restart at 0 in each document, `loss_mask` (float32) is 1 where a target exists.
Each process reads its own slice of the documents (`shard_index`/`shard_count`)
and yields its rows of the global batch. The iterator is a grain `DatasetIterator`:
`get_state()` / `set_state()` resume it exactly (the checkpoint stores that state).
"""
from __future__ import annotations

import dataclasses

import grain
import numpy as np

from k25jax.data.tokenizer import Tokenizer

FEATURES = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


@dataclasses.dataclass(frozen=True)
class Chunk(grain.experimental.FlatMapTransform):
  """Cuts a token array into (inputs, targets) pairs of at most `seq_len` tokens."""

  seq_len: int
  max_fan_out: int

  def flat_map(self, tokens: np.ndarray):
    pieces = []
    for start in range(0, max(len(tokens) - 1, 0), self.seq_len):
      piece = tokens[start:start + self.seq_len + 1]
      pieces.append({"inputs": piece[:-1], "targets": piece[1:]})
    return pieces


def tokenize_fn(tokenizer: Tokenizer):
  """document → [BOS] + ids + [EOS]; a document is text, or its ids already (token shards)."""
  def tokenize(doc) -> np.ndarray:
    ids = tokenizer.encode(doc) if isinstance(doc, str) else doc
    return np.concatenate([[tokenizer.bos_id], ids, [tokenizer.eos_id]]).astype(np.int32)
  return tokenize


def packed_features(row: dict) -> dict:
  """Grain's packed row → the model's features."""
  return {
      "inputs": row["inputs"].astype(np.int32),
      "targets": row["targets"].astype(np.int32),
      "positions": row["inputs_positions"].astype(np.int32),
      "segment_ids": row["inputs_segment_ids"].astype(np.int32),
      "loss_mask": (row["targets_segment_ids"] > 0).astype(np.float32),
  }


def chunks(docs, tokenizer: Tokenizer, *, seq_len: int, seed: int, max_doc_tokens: int,
           shuffle: bool = True, shard_index: int = 0, shard_count: int = 1) -> grain.IterDataset:
  """Endless (inputs, targets) chunks of this process's slice of `docs` (a list, or a grain
  MapDataset, of texts or token ids), tokenized, in an order reshuffled each epoch (or in order)."""
  ds = (docs if isinstance(docs, grain.MapDataset) else grain.MapDataset.source(docs))[shard_index::shard_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(None).map(tokenize_fn(tokenizer)).to_iter_dataset()
  return grain.experimental.FlatMapIterDataset(ds, Chunk(seq_len=seq_len, max_fan_out=max_doc_tokens // seq_len + 2))


def packed(chunk_stream: grain.IterDataset, *, seq_len: int, batch: int, seed: int,
           shuffle: bool = True) -> grain.IterDataset:
  """Chunks first-fit packed into [batch, seq_len] rows of the model's features."""
  ds = grain.experimental.FirstFitPackIterDataset(
      chunk_stream, length_struct={"inputs": seq_len, "targets": seq_len}, num_packing_bins=batch,
      seed=seed, shuffle_bins=shuffle)
  return ds.map(packed_features).batch(batch, drop_remainder=True)


def lm_dataset(docs, tokenizer: Tokenizer, *, seq_len: int, batch: int, seed: int,
               max_doc_tokens: int, shuffle: bool = True, shard_index: int = 0,
               shard_count: int = 1) -> grain.IterDataset:
  """Endless packed batches ([batch, seq_len] numpy features) over `docs`, reshuffled each epoch."""
  stream = chunks(docs, tokenizer, seq_len=seq_len, seed=seed, max_doc_tokens=max_doc_tokens, shuffle=shuffle,
                  shard_index=shard_index, shard_count=shard_count)
  return packed(stream, seq_len=seq_len, batch=batch, seed=seed, shuffle=shuffle)


def take(dataset: grain.IterDataset, n: int) -> list[dict]:
  """The first `n` batches (e.g. a fixed evaluation set)."""
  it = iter(dataset)
  return [next(it) for _ in range(n)]
