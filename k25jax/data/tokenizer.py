"""Tokenizers that need no download: raw bytes, and byte-pair encoding from a local
tiktoken-format vocabulary (the format of Kimi's `tiktoken.model`).

Packed rows pad with id 0 (`PAD_ID`); padding is never a target (the loss mask is 0
there), so with a BPE vocabulary id 0 may double as a real token.

With `media=True` a tokenizer also has the four media tokens of K2.5 (`tok.media`,
see k25jax/data/vision.py): ids 259..262 after the bytes, or the released ids
163602..163605 with a tiktoken vocabulary. Without it, `tok.media` is None and the
ids and vocabulary size are unchanged.
"""
from __future__ import annotations

import base64
import os
from typing import NamedTuple, Protocol, Sequence

PAD_ID = 0

# The cl100k pre-tokenizer split (letters, 1–3 digit numbers, punctuation runs, spaces).
CL100K_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class MediaIds(NamedTuple):
  """Ids of <|media_begin|>, <|media_content|>, <|media_end|> and <|media_pad|> (the placeholder)."""

  begin: int
  content: int
  end: int
  pad: int


MEDIA_TOKENS = MediaIds("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
K25_MEDIA_IDS = MediaIds(begin=163602, content=163603, end=163604, pad=163605)


def decode_with_media(ids: Sequence[int], media: MediaIds | None, decode_run) -> str:
  """`decode_run` over the runs between media ids, which are written by name."""
  names = dict(zip(media, MEDIA_TOKENS)) if media else {}
  out, run = [], []
  for i in (int(i) for i in ids):
    if i in names:
      out += [decode_run(run), names[i]]
      run = []
    else:
      run.append(i)
  return "".join(out + [decode_run(run)])


class Tokenizer(Protocol):
  vocab_size: int
  bos_id: int
  eos_id: int
  media: MediaIds | None

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes: byte b ↦ id b + 3; 0 = PAD, 1 = BOS, 2 = EOS; vocab 259, or 263 with
  the media tokens at 259..262."""

  offset = 3
  bos_id = 1
  eos_id = 2

  def __init__(self, media: bool = False):
    first = 256 + self.offset
    self.media = MediaIds(*range(first, first + 4)) if media else None
    self.vocab_size = first + (4 if media else 0)

  def encode(self, text: str) -> list[int]:
    return [b + self.offset for b in text.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    return decode_with_media(ids, self.media, self.decode_bytes)

  def decode_bytes(self, ids: Sequence[int]) -> str:
    return bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < 256 + self.offset).decode(
        "utf-8", "replace")


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
  """Parses a tiktoken vocabulary: one `base64(token) rank` per line."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"tiktoken vocabulary {path!r} does not exist (no download is attempted)")
  ranks = {}
  with open(path, "rb") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      parts = line.split()
      if len(parts) != 2:
        raise ValueError(f"{path}:{n}: expected 'base64-token rank', got {line[:80]!r}")
      ranks[base64.b64decode(parts[0])] = int(parts[1])
  return ranks


def bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
  """Byte-pair merges as tiktoken does them: repeatedly merge the adjacent pair whose
  concatenation has the lowest rank, until no adjacent pair is in the vocabulary."""
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
  missing = [p for p in parts if p not in ranks]
  if missing:
    raise ValueError(f"tiktoken vocabulary has no token for bytes {missing[0]!r}")
  return [ranks[p] for p in parts]


class TiktokenTokenizer:
  """Pure-Python BPE over a local tiktoken vocabulary file (needs the `regex` package for
  the pre-tokenizer pattern). BOS / EOS follow the largest rank unless given."""

  def __init__(self, path: str, pattern: str = CL100K_PATTERN, bos_id: int | None = None,
               eos_id: int | None = None, media: bool = False):
    try:
      import regex  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError("the tiktoken-format tokenizer needs the `regex` package: pip install regex") from e
    self.ranks = read_tiktoken_ranks(path)
    self.tokens = {rank: token for token, rank in self.ranks.items()}
    self.pattern = regex.compile(pattern)
    top = max(self.ranks.values())
    self.bos_id = top + 1 if bos_id is None else bos_id
    self.eos_id = top + 2 if eos_id is None else eos_id
    self.media = K25_MEDIA_IDS if media else None
    self.vocab_size = max(top, self.bos_id, self.eos_id, *(self.media or ())) + 1
    self.cache: dict[bytes, list[int]] = {}

  def encode(self, text: str) -> list[int]:
    ids = []
    for match in self.pattern.finditer(text):
      piece = match.group().encode("utf-8")
      if piece not in self.cache:
        self.cache[piece] = bpe(piece, self.ranks)
      ids.extend(self.cache[piece])
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    return decode_with_media(
        ids, self.media, lambda run: b"".join(self.tokens.get(int(i), b"") for i in run).decode("utf-8", "replace"))


def load(name: str, vocab_file: str = "", media: bool = False) -> Tokenizer:
  """`bytes` (default), or `tiktoken` with `vocab_file` a local tiktoken vocabulary;
  `media` adds the media tokens."""
  if name == "bytes":
    return ByteTokenizer(media)
  if name == "tiktoken":
    if not vocab_file:
      raise ValueError("data.tokenizer='tiktoken' needs data.vocab_file (a local tiktoken vocabulary)")
    return TiktokenTokenizer(vocab_file, media=media)
  raise ValueError(f"data.tokenizer={name!r}; choose 'bytes' or 'tiktoken'")
