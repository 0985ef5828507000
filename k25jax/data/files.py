"""Pre-training text from the user's files: `data.source=files`.

    data.files = "GLOB[:WEIGHT],GLOB[:WEIGHT],..."

Each entry is one source: the files its glob matches (sorted; `~` and `**` expanded), read
by extension — `.jsonl` and `.jsonl.gz` (one JSON object a line) and `.parquet` (pyarrow) —
with each record's `data.text_field` one document, in file and record order; or a folder of
token shares made by `python -m k25jax.data.prepare` (`k25jax/data/shards.py`: read with
grain's random access, never into memory whole; its tokenizer must be the run's). WEIGHT (default
1) is the source's share of the training tokens, the weights normalised over the entries.
Every `data.eval_every`-th document of each source is held out, as for the built-in sources;
with `data.eval_files` (globs, no weights) those files are the held-out set instead and the
training files are not split.

Shares by tokens. Each source is an endless stream of chunks (`pipeline.chunks`: its
documents shuffled each epoch, tokenized, cut into (inputs, targets) pieces of at most
seq_len targets); the mixture takes a chunk from source i in proportion

    p_i ∝ w_i / c_i,     c_i = the mean number of targets in a chunk of source i

(measured on up to `SAMPLE_DOCS` of its documents, evenly spaced), so the expected share of
source i's tokens among the targets is p_i c_i / Σ_j p_j c_j = w_i. The mixed chunks are then
packed as one stream (`pipeline.packed`). Grain's mixture keeps its position in the iterator
state, so a resumed run continues it exactly.

A file that cannot be read, a record that is not a JSON object, lacks the field or holds no
text, and a glob that matches nothing raise `BadData`, one line naming the file (and line or
row); `python -m k25jax.main` exits 2 on it. With `data.on_bad_record=skip` a bad *record* is
skipped instead, and once the files are read one warning gives how many were skipped and the
first three (a file that cannot be read, or a source left empty, still stops the run).
"""
from __future__ import annotations

import glob
import gzip
import json
import os

import grain
import numpy as np
from absl import logging

from k25jax.data import pipeline, shards
from k25jax.data.tokenizer import Tokenizer

FORMATS = (".jsonl", ".jsonl.gz", ".parquet")
ON_BAD_RECORD = ("error", "skip")
SAMPLE_DOCS = 512


class BadData(ValueError):
  """A data file, record or spec that cannot be used; the message names it."""


def parse(spec: str, field: str = "data.files", weights: bool = True) -> list[tuple[str, float]]:
  """`"GLOB[:WEIGHT],..."` → [(glob, weight)] (weight 1 where none is given)."""
  entries = [e.strip() for e in spec.split(",") if e.strip()]
  if not entries:
    raise BadData(f"{field}={spec!r}: give one or more GLOB[:WEIGHT] entries, comma-separated")
  out = []
  for entry in entries:
    pattern, _, weight = entry.rpartition(":")
    if not pattern or os.sep in weight or "*" in weight:   # no weight: the colon, if any, is the path's
      out.append((entry, 1.0))
      continue
    if not weights:
      raise BadData(f"{field}: {entry!r}: these files take no weight (weights are shares of a pre-training mixture)")
    try:
      value = float(weight)
    except ValueError:
      raise BadData(f"{field}: {entry!r}: the weight {weight!r} is not a number") from None
    if not np.isfinite(value) or value <= 0:
      raise BadData(f"{field}: {entry!r}: the weight must be a finite number > 0")
    out.append((pattern, value))
  return out


def matching(pattern: str, field: str = "data.files") -> list[str]:
  """The files `pattern` matches, sorted; BadData if none or one of an unknown format."""
  paths = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
  if not paths:
    raise BadData(f"{field}: {pattern!r} matches no file")
  for path in paths:
    if not path.endswith(FORMATS):
      raise BadData(f"{path}: unknown format (from {field}={pattern!r}); data files are {', '.join(FORMATS)}")
  return paths


class BadRecords:
  """What a read does with a bad record (`data.on_bad_record`): raise its BadData ("error"), or
  ("skip") count it, keep its message and go on; `report` logs them once the files are read."""

  def __init__(self, policy: str = "error"):
    if policy not in ON_BAD_RECORD:
      raise BadData(f"config: data.on_bad_record={policy!r}: must be one of {ON_BAD_RECORD}")
    self.skip, self.messages = policy == "skip", []

  def found(self, message: str) -> None:
    if not self.skip:
      raise BadData(message)
    self.messages.append(message)

  def report(self, field: str) -> None:
    if self.messages:
      logging.warning("%s: skipped %d bad record(s) (data.on_bad_record=skip): %s%s", field, len(self.messages),
                      "; ".join(self.messages[:3]), " ..." if len(self.messages) > 3 else "")


def _text(path: str, where: str, record, field: str) -> str:
  if not isinstance(record, dict):
    raise BadData(f"{path}:{where}: not a JSON object")
  if field not in record:
    raise BadData(f"{path}:{where}: no {field!r} field (data.text_field); it has {sorted(record)[:8]}")
  text = record[field]
  if not isinstance(text, str):
    raise BadData(f"{path}:{where}: {field!r} is {type(text).__name__}, not text")
  return text


def jsonl_records(path: str, bad: BadRecords):
  """(line number, parsed JSON) of every non-blank line of a .jsonl or .jsonl.gz file; a line
  that is not JSON goes to `bad` (raised or skipped), a file that cannot be read is BadData."""
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      for number, line in enumerate(f, start=1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          bad.found(f"{path}:{number}: not JSON ({e.msg} at column {e.colno})")
          continue
        yield number, record
  except (OSError, EOFError, UnicodeDecodeError) as e:
    raise BadData(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def records(path: str, bad: BadRecords):
  """(where, record) of every record of one .jsonl, .jsonl.gz or .parquet file, `where` being
  "path:line" or "path:row N"; a Parquet row's null columns are left out (the field is absent,
  as in JSONL). A JSONL line that is not JSON goes to `bad`; a file that cannot be read is BadData."""
  if path.endswith(".parquet"):
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
      rows = pq.read_table(path).to_pylist()
    except (OSError, pa.ArrowException) as e:
      raise BadData(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    for i, row in enumerate(rows):
      yield f"{path}:row {i}", {k: v for k, v in row.items() if v is not None}
    return
  for number, record in jsonl_records(path, bad):
    yield f"{path}:{number}", record


def _jsonl(path: str, field: str, bad: BadRecords) -> list[str]:
  docs = []
  for number, record in jsonl_records(path, bad):
    try:
      docs.append(_text(path, str(number), record, field))
    except BadData as e:
      bad.found(str(e))
  return docs


def _parquet(path: str, field: str, bad: BadRecords) -> list[str]:
  import pyarrow as pa
  import pyarrow.parquet as pq
  try:
    schema = pq.read_schema(path)
    if field not in schema.names:
      raise BadData(f"{path}: no {field!r} column (data.text_field); it has {schema.names[:8]}")
    column = pq.read_table(path, columns=[field]).column(field)
  except (OSError, pa.ArrowException) as e:
    raise BadData(f"{path}: unreadable ({type(e).__name__}: {e})") from None
  docs = []
  for row, text in enumerate(column.to_pylist()):
    if isinstance(text, str):
      docs.append(text)
    else:
      bad.found(f"{path}:row {row}: {field!r} is {type(text).__name__}, not text")
  return docs


def read(path: str, field: str, bad: BadRecords | None = None) -> list[str]:
  """The documents of one file (module docstring); bad records by `bad`'s policy (default: raise)."""
  bad = BadRecords() if bad is None else bad
  return _parquet(path, field, bad) if path.endswith(".parquet") else _jsonl(path, field, bad)


def _documents(pattern: str, field: str, spec_field: str, bad: BadRecords) -> list[str]:
  docs = [d for path in matching(pattern, spec_field) for d in read(path, field, bad)]
  if not docs:
    raise BadData(f"{spec_field}: {pattern!r} holds no document")
  return docs


def _shard_source(folder: str, tok: Tokenizer, field: str) -> grain.MapDataset:
  try:
    _, docs = shards.open_folder(folder, tok)
  except (OSError, ValueError, KeyError) as e:
    raise BadData(f"{field}: {folder}: {e}") from None
  if not len(docs):
    raise BadData(f"{field}: {folder!r} holds no document")
  return docs


def _source(pattern: str, data, tok: Tokenizer | None, field: str, bad: BadRecords):
  """An entry's documents: a list of texts (files), or a MapDataset of ids (a prepared folder)."""
  folder = os.path.expanduser(pattern)
  if shards.is_prepared(folder):
    if tok is None:
      raise BadData(f"{field}: {folder} holds token shards, which feed text pre-training; this stage reads "
                    ".jsonl, .jsonl.gz or .parquet files")
    return _shard_source(folder, tok, field)
  return _documents(pattern, data.text_field, field, bad)


def _split(docs, every: int):
  """(training, held-out) documents: every `every`-th held out."""
  if isinstance(docs, list):
    return [d for k, d in enumerate(docs) if k % every], docs[::every]
  n = len(docs)
  held_out = [docs[k] for k in range(0, n, every)]
  if every == 1:
    return grain.MapDataset.source([]), held_out
  return grain.MapDataset.range(n - len(held_out)).map(lambda j: docs[j + j // (every - 1) + 1]), held_out


def load(data, tok: Tokenizer | None = None) -> tuple[list[tuple[float, object]], list]:
  """([(token share, training documents)] per entry of `data.files`, held-out documents);
  `tok` opens prepared folders (None: files only)."""
  entries, bad = parse(data.files), BadRecords(data.get("on_bad_record", "error"))
  sources = [(w, _source(pattern, data, tok, "data.files", bad)) for pattern, w in entries]
  if data.eval_files:
    held_out = [d for pattern, _ in parse(data.eval_files, "data.eval_files", weights=False)
                for d in _source(pattern, data, tok, "data.eval_files", bad)]
  else:
    splits = [_split(docs, data.eval_every) for _, docs in sources]
    held_out = [d for _, part in splits for d in part]
    sources = [(w, train) for (w, _), (train, _) in zip(sources, splits)]
  for (pattern, _), (_, train) in zip(entries, sources):
    if not len(train):
      raise BadData(f"data.files: {pattern!r}: no training document is left after holding out every "
                    f"data.eval_every={data.eval_every}-th")
  bad.report("data.files")
  total = sum(w for w, _ in sources)
  return [(w / total, docs) for w, docs in sources], held_out


def single_source(data) -> tuple[list[str], list[str]]:
  """(training, held-out) documents of a `data.files` with one entry: the stages whose text
  goes into a vision mixture (joint pre-training, mid-training) take one text source."""
  if len(parse(data.files)) > 1:
    raise BadData(f"data.files={data.files!r}: this stage mixes its text with images and takes one text source "
                  "(one GLOB, no weight); token-weighted mixtures of files are text pre-training's")
  [(_, train)], held_out = load(data)
  return train, held_out


def max_doc_tokens(docs) -> int:
  """`pipeline.Chunk`'s fan-out bound from the texts among `docs`: 4 bytes a character, BOS
  and EOS (grain's iterator flat map does not enforce it, so documents of token shards, which
  are not read up front, need none)."""
  return 4 * max((len(d) for d in docs if isinstance(d, str)), default=0) + 2


def _length(doc, tok: Tokenizer) -> int:
  return len(tok.encode(doc)) if isinstance(doc, str) else len(doc)


def targets_per_chunk(docs, tok: Tokenizer, seq_len: int) -> float:
  """c: the mean number of targets in a chunk (module docstring), over up to SAMPLE_DOCS
  evenly spaced documents."""
  picks = np.unique(np.linspace(0, len(docs) - 1, min(len(docs), SAMPLE_DOCS)).astype(int))
  targets = np.array([_length(docs[int(i)], tok) + 1 for i in picks])     # [BOS] + ids + [EOS]: n + 1 targets
  return float(targets.sum() / np.ceil(targets / seq_len).sum())


def mixture(sources: list[tuple[float, list[str]]], tok: Tokenizer, *, seq_len: int, batch: int, seed: int,
            max_doc_tokens: int, shard_index: int = 0, shard_count: int = 1) -> grain.IterDataset:
  """Endless packed batches drawing each source's tokens in its share (module docstring)."""
  streams = [pipeline.chunks(docs, tok, seq_len=seq_len, seed=seed + i, max_doc_tokens=max_doc_tokens,
                             shard_index=shard_index, shard_count=shard_count) for i, (_, docs) in enumerate(sources)]
  proportions = [w / targets_per_chunk(docs, tok, seq_len) for w, docs in sources]
  stream = streams[0] if len(streams) == 1 else grain.IterDataset.mix(streams, proportions)
  return pipeline.packed(stream, seq_len=seq_len, batch=batch, seed=seed)
