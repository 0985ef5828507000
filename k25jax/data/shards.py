"""Token shards: documents tokenized once (`python -m k25jax.data.prepare`) into ArrayRecord
files of token ids, read back with grain's random access.

A prepared folder holds `shard-NNNNN.array_record` files (record i: document i's ids, int32
little-endian, without BOS/EOS) and `manifest.json`: the tokenizer's fingerprint, the
documents, tokens and longest document, each shard's counts, and the source files with their
sizes. A shard file appears only once whole (written under a temporary name, then renamed).

The fingerprint identifies a tokenizer by what it does, not where its file lies: its class,
BOS and EOS ids and the ids it gives `PROBE` (scripts, digits, whitespace, code), hashed. A run
whose tokenizer's fingerprint differs from the manifest's is refused: its ids would mean
other strings.
"""
from __future__ import annotations

import hashlib
import json
import os

import grain
import numpy as np

from k25jax.data.tokenizer import Tokenizer

MANIFEST = "manifest.json"
FORMAT = "k25jax-token-shards/1"
PROBE = ("The quick brown fox, 12345 and 3.14159; def f(x):\n\treturn x ** 2  # 你好世界 Привет мир "
         "CamelCASE snake_case HTTPServer ‘quotes’ — emoji 🙂\n\n")


def fingerprint(tok: Tokenizer) -> str:
  """sha256 of (class, BOS, EOS, ids of PROBE): equal for tokenizers that encode text alike."""
  what = [type(tok).__name__, int(tok.bos_id), int(tok.eos_id), [int(i) for i in tok.encode(PROBE)]]
  return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def shard_name(index: int) -> str:
  return f"shard-{index:05d}.array_record"


def write_shard(folder: str, index: int, documents: list[np.ndarray]) -> dict:
  """Writes one shard (temporary name, then renamed); its {file, documents, tokens, longest}."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=import-outside-toplevel
  path = os.path.join(folder, shard_name(index))
  staging = f"{path}.tmp{os.getpid()}"
  writer = ArrayRecordWriter(staging, "group_size:1")
  for ids in documents:
    writer.write(np.asarray(ids, "<i4").tobytes())
  writer.close()
  os.replace(staging, path)
  return shard_counts(folder, index)


def shard_counts(folder: str, index: int) -> dict:
  """{file, documents, tokens, longest} of a written shard, read from the file."""
  lengths = [len(r) // 4 for r in grain.sources.ArrayRecordDataSource([os.path.join(folder, shard_name(index))])]
  return {"file": shard_name(index), "documents": len(lengths), "tokens": int(sum(lengths)),
          "longest": int(max(lengths, default=0))}


def is_prepared(path: str) -> bool:
  return os.path.isfile(os.path.join(path, MANIFEST))


def read_manifest(folder: str) -> dict:
  with open(os.path.join(folder, MANIFEST)) as f:
    return json.load(f)


def open_folder(folder: str, tok: Tokenizer) -> tuple[dict, grain.MapDataset]:
  """(manifest, the documents' ids as int32 arrays, random access); ValueError naming the
  folder when the run's tokenizer is not the one the shards were made with."""
  manifest = read_manifest(folder)
  if manifest.get("tokenizer") != fingerprint(tok):
    raise ValueError(f"{folder}: its shards were tokenized by another tokenizer than this run's "
                     f"(data.tokenizer); prepare them again with this run's, or set the tokenizer they were made with")
  source = grain.sources.ArrayRecordDataSource([os.path.join(folder, s["file"]) for s in manifest["shards"]])
  return manifest, grain.MapDataset.source(source).map(lambda record: np.frombuffer(record, "<i4"))
