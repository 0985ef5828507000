"""Tokenize text files once into token shards (`k25jax/data/shards.py`) that runs read with
`data.source=files data.files=DIR`:

    python -m k25jax.data.prepare --input="corpus/*.jsonl.gz" --out=DIR --tokenizer=bytes|PATH \
        [--text_field=text] [--workers=N] [--docs_per_shard=10000] [--on_bad_record=error|skip]

The documents of the input files (sorted by the glob, read as `data.files` reads them) go in
order into shards of `docs_per_shard`: shard k holds documents k·n .. (k+1)·n − 1, so the
shards depend only on the inputs, the tokenizer and n. `--tokenizer` is `bytes` or a
tokenizer file or checkpoint folder (`data.tokenizer=auto`). Interrupted, it resumes after its
last whole shard (`DIR/prepare.json` records what it was asked, and a resume with other
inputs, tokenizer or n is refused); run again on a finished DIR it does nothing. A progress
line gives documents/s and the ETA. `--workers` tokenizes in that many processes. A bad record
stops it in one line, or (`--on_bad_record=skip`) is skipped and counted as a run skips it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy as np

from k25jax.data import files, shards, tokenizer

PLAN = "prepare.json"


def _count(path: str) -> int:
  """The records of one input file (the progress line's total)."""
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    return pq.ParquetFile(path).metadata.num_rows
  import gzip  # pylint: disable=import-outside-toplevel
  with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
    return sum(1 for line in f if line.strip())


_TOKENIZER = None


def _set_tokenizer(spec: str) -> None:
  global _TOKENIZER
  _TOKENIZER = load_tokenizer(spec)


def _encode(text: str) -> np.ndarray:
  return np.asarray(_TOKENIZER.encode(text), np.int32)


def load_tokenizer(spec: str):
  """`bytes`, or a tokenizer file / checkpoint folder (as `data.tokenizer=auto` reads it)."""
  return tokenizer.load("bytes") if spec == "bytes" else tokenizer.load("auto", spec)


def _plan(paths: list[str], tok, text_field: str, docs_per_shard: int, on_bad_record: str) -> dict:
  return {"format": shards.FORMAT, "tokenizer": shards.fingerprint(tok), "text_field": text_field,
          "docs_per_shard": docs_per_shard, "on_bad_record": on_bad_record,
          "sources": [{"path": os.path.abspath(p), "bytes": os.path.getsize(p)} for p in paths]}


def _progress(done: int, total: int, start: float, first: int) -> None:
  rate = (done - first) / max(time.perf_counter() - start, 1e-9)
  eta = (total - done) / rate if rate > 0 else float("nan")
  eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) if np.isfinite(eta) else "?"
  sys.stderr.write(f"\rprepare: {done:,}/{total:,} documents ({rate:,.0f} docs/s, ETA {eta_text})")
  sys.stderr.flush()


def prepare(pattern: str, out: str, tokenizer_spec: str = "bytes", text_field: str = "text", workers: int = 1,
            docs_per_shard: int = 10_000, progress: bool = True, on_bad_record: str = "error") -> dict:
  """Writes (or finishes) the shards of `pattern`'s files under `out`; returns the manifest."""
  if docs_per_shard < 1 or workers < 1:
    raise files.BadData(f"--docs_per_shard={docs_per_shard} and --workers={workers}: each must be >= 1")
  bad = files.BadRecords(on_bad_record)
  tok = load_tokenizer(tokenizer_spec)
  paths = [p for entry, _ in files.parse(pattern, "--input", weights=False) for p in files.matching(entry, "--input")]
  plan = _plan(paths, tok, text_field, docs_per_shard, on_bad_record)
  os.makedirs(out, exist_ok=True)
  if shards.is_prepared(out):
    manifest = shards.read_manifest(out)
    if {k: manifest.get(k) for k in plan} != plan:
      raise files.BadData(f"{out} holds shards of other inputs, tokenizer or --docs_per_shard; "
                          "prepare into a new --out")
    return manifest
  plan_path = os.path.join(out, PLAN)
  if os.path.exists(plan_path):
    with open(plan_path) as f:
      if json.load(f) != plan:
        raise files.BadData(f"{out}: an interrupted prepare of other inputs, tokenizer or --docs_per_shard; "
                            "resume it with its own arguments or prepare into a new --out")
  else:
    with open(plan_path, "w") as f:
      json.dump(plan, f, indent=1)
  written = 0
  while os.path.exists(os.path.join(out, shards.shard_name(written))):
    written += 1
  skip, total = written * docs_per_shard, sum(_count(p) for p in paths)
  counts = [shards.shard_counts(out, k) for k in range(written)]
  texts = (d for p in paths for d in files.read(p, text_field, bad))
  pool = multiprocessing.get_context("spawn").Pool(workers, _set_tokenizer, (tokenizer_spec,)) if workers > 1 else None
  if pool is None:
    _set_tokenizer(tokenizer_spec)
    encode = lambda batch: [_encode(t) for t in batch]
  else:
    encode = lambda batch: pool.map(_encode, batch, chunksize=64)
  start, done, batch = time.perf_counter(), 0, []
  try:
    for text in texts:
      done += 1
      if done <= skip:
        continue
      batch.append(text)
      if len(batch) == docs_per_shard:
        counts.append(shards.write_shard(out, len(counts), encode(batch)))
        batch = []
        if progress:
          _progress(done, total, start, skip)
    if batch:
      counts.append(shards.write_shard(out, len(counts), encode(batch)))
  finally:
    if pool is not None:
      pool.close()
  if progress:
    _progress(done, total, start, skip)
    sys.stderr.write("\n")
  bad.report("--input")
  manifest = {**plan, "documents": sum(c["documents"] for c in counts), "tokens": sum(c["tokens"] for c in counts),
              "longest": max((c["longest"] for c in counts), default=0), "skipped_records": len(bad.messages),
              "shards": counts}
  with open(os.path.join(out, shards.MANIFEST + ".tmp"), "w") as f:
    json.dump(manifest, f, indent=1)
  os.replace(os.path.join(out, shards.MANIFEST + ".tmp"), os.path.join(out, shards.MANIFEST))
  return manifest


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--input", required=True, help='GLOB[,GLOB...] of .jsonl, .jsonl.gz and .parquet files')
  parser.add_argument("--out", required=True, help="the folder of the shards and manifest.json")
  parser.add_argument("--tokenizer", default="bytes", help="bytes, or a tokenizer file or checkpoint folder")
  parser.add_argument("--text_field", default="text")
  parser.add_argument("--workers", type=int, default=1)
  parser.add_argument("--docs_per_shard", type=int, default=10_000)
  parser.add_argument("--on_bad_record", default="error", choices=files.ON_BAD_RECORD)
  args = parser.parse_args(argv)
  try:
    manifest = prepare(args.input, args.out, args.tokenizer, args.text_field, args.workers, args.docs_per_shard,
                       on_bad_record=args.on_bad_record)
  except (ValueError, FileNotFoundError) as e:
    sys.stderr.write(f"error: {e}\n")
    return 2
  print(f"{args.out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens in "
        f"{len(manifest['shards'])} shards")
  return 0


if __name__ == "__main__":
  sys.exit(main())
