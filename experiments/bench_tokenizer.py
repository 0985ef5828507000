"""Encode throughput: `tiktoken` (Rust, what k25jax/data/tokenizer_files.py uses) against the
pure-Python byte-pair encoder it replaced, on the same vocabulary and the same text.

The vocabulary is trained here (no download): `merges` byte-pair merges over the standard
library's source split by Kimi's pre-tokenizer pattern, written as a tiktoken file. The
text is that source again (`--chars` of it). Both encoders run interleaved in one process,
`--repeats` times each; the table gives tokens/s (min / median / max) and whether the ids
agree. The Python encoder caches pieces, as it did in k25jax; a fresh cache each repeat.

    python experiments/bench_tokenizer.py [--merges 2000] [--chars 400000] [--repeats 5]
"""
from __future__ import annotations

import argparse
import base64
import collections
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import regex

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from k25jax.data import tokenizer_files  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_tokenizer.json")


def stdlib_text(chars: int) -> str:
  """The first `chars` characters of the standard library's .py files, in sorted path order."""
  out, total = [], 0
  for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
    with open(path, encoding="utf-8", errors="replace") as f:
      text = f.read()
    out.append(text)
    total += len(text)
    if total >= chars:
      break
  return "".join(out)[:chars]


def train_ranks(text: str, merges: int, pattern: str = tokenizer_files.KIMI_PATTERN) -> dict[bytes, int]:
  """256 byte tokens, then `merges` tokens: each the most frequent adjacent pair of the
  pieces (ties: the smaller bytes), merged everywhere before the next is chosen."""
  words = collections.Counter(m.group().encode("utf-8") for m in regex.finditer(pattern, text, flags=regex.V1))
  split = {w: [w[i:i + 1] for i in range(len(w))] for w in words}
  ranks = {bytes([b]): b for b in range(256)}
  for _ in range(merges):
    pairs = collections.Counter()
    for w, parts in split.items():
      for a, b in zip(parts, parts[1:]):
        pairs[a, b] += words[w]
    if not pairs:
      break
    best = min(pairs, key=lambda p: (-pairs[p], p))
    ranks[best[0] + best[1]] = len(ranks)
    for w, parts in split.items():
      i = 0
      while i < len(parts) - 1:
        if (parts[i], parts[i + 1]) == best:
          parts[i:i + 2] = [best[0] + best[1]]
        else:
          i += 1
  return ranks


def write_tiktoken(ranks: dict[bytes, int], path: str) -> str:
  with open(path, "w") as f:
    f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
  return path


def python_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
  """The replaced encoder's merge loop: merge the adjacent pair whose concatenation has the
  lowest rank until no pair is in the vocabulary."""
  if piece in ranks:
    return [ranks[piece]]
  parts = [piece[i:i + 1] for i in range(len(piece))]
  while len(parts) > 1:
    best, best_rank = -1, None
    for i in range(len(parts) - 1):
      rank = ranks.get(parts[i] + parts[i + 1])
      if rank is not None and (best_rank is None or rank < best_rank):
        best, best_rank = i, rank
    if best < 0:
      break
    parts[best:best + 2] = [parts[best] + parts[best + 1]]
  return [ranks[p] for p in parts]


def python_encode(text: str, ranks: dict[bytes, int], pattern: str = tokenizer_files.KIMI_PATTERN) -> list[int]:
  """The replaced pure-Python encoder: split by `pattern`, each piece byte-pair encoded (cached)."""
  compiled, cache, ids = regex.compile(pattern, flags=regex.V1), {}, []   # V1: the `&&` class intersections
  for match in compiled.finditer(text):
    piece = match.group().encode("utf-8")
    if piece not in cache:
      cache[piece] = python_bpe(piece, ranks)
    ids.extend(cache[piece])
  return ids


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--merges", type=int, default=2000)
  parser.add_argument("--chars", type=int, default=400_000)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args(argv)
  text = stdlib_text(args.chars)
  ranks = train_ranks(text[:100_000], args.merges)
  with tempfile.TemporaryDirectory() as tmp:
    tok = tokenizer_files.TiktokenTokenizer(write_tiktoken(ranks, os.path.join(tmp, "tiktoken.model")))
  encoders = {"tiktoken": tok.encode, "python": lambda t: python_encode(t, ranks)}
  seconds, ids = collections.defaultdict(list), {}
  for _ in range(args.repeats):
    for name, encode in encoders.items():    # interleaved: the machine's load falls on both
      start = time.perf_counter()
      ids[name] = encode(text)
      seconds[name].append(time.perf_counter() - start)
  count = len(ids["tiktoken"])
  rows = {name: {"tokens_per_s": {"min": count / max(s), "median": count / statistics.median(s), "max": count / min(s)},
                 "seconds": s} for name, s in seconds.items()}
  result = {"chars": len(text), "tokens": count, "vocabulary": len(ranks), "repeats": args.repeats,
            "ids_equal": ids["tiktoken"] == ids["python"], "encoders": rows,
            "speedup_median": rows["tiktoken"]["tokens_per_s"]["median"] / rows["python"]["tokens_per_s"]["median"]}
  print(f"{len(text):,} characters of the standard library, {count:,} tokens, a {len(ranks):,}-token vocabulary; "
        f"ids equal: {result['ids_equal']}")
  print(f"{'encoder':10s} {'tokens/s min':>14s} {'median':>12s} {'max':>12s}")
  for name, row in rows.items():
    t = row["tokens_per_s"]
    print(f"{name:10s} {t['min']:14,.0f} {t['median']:12,.0f} {t['max']:12,.0f}")
  print(f"tiktoken / python (medians): {result['speedup_median']:.1f}x")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
