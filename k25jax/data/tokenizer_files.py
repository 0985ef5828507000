"""Tokenizers from a checkpoint's files, encoded by the libraries that own the formats.

* `tiktoken.model` (Kimi K2 / K2.5): one `base64(token) rank` line per token, encoded by
  `tiktoken` with Kimi's pre-tokenizer split (`KIMI_PATTERN`: Han runs, case-aware letter
  runs, 1-3 digit numbers, punctuation runs, newlines, spaces). The 256 ids after the base
  ranks are special: names from the folder's `tokenizer_config.json` (`added_tokens_decoder`)
  where it is there, else the released layout (`KIMI_SPECIAL_IDS`, counted from the first id
  after the base vocabulary: a vocabulary of Kimi's 163,584 ranks gets the released ids),
  and `<|reserved_token_{id}|>` for the rest.
* `tokenizer.json` (DeepSeek-V3 family, or anything `tokenizers` reads): the special ids are
  its added tokens.

Neither downloads anything: a missing file is an error naming it.
"""
from __future__ import annotations

import base64
import json
import os
from typing import Sequence

from k25jax.data import special_tokens

KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_RESERVED_SPECIAL_TOKENS = 256
KIMI_BASE_VOCAB = 163584
# The released special tokens of Kimi K2 / K2.5 (tokenizer_config.json's added_tokens_decoder).
KIMI_SPECIAL_IDS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587, "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590, "<|end_header_id|>": 163591, "[EOT]": 163593, "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595, "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
    "<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604, "<|media_pad|>": 163605,
    "<think>": 163606, "</think>": 163607,
}
TIKTOKEN_FILE, TOKENIZER_JSON, TOKENIZER_CONFIG = "tiktoken.model", "tokenizer.json", "tokenizer_config.json"


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
  """A tiktoken vocabulary file: one `base64(token) rank` per line."""
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


def _configured_specials(folder: str) -> dict[str, int]:
  """name -> id from the folder's tokenizer_config.json (empty without one)."""
  path = os.path.join(folder, TOKENIZER_CONFIG)
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    decoder = json.load(f).get("added_tokens_decoder") or {}
  return {entry["content"]: int(i) for i, entry in decoder.items()}


def kimi_specials(num_base: int, configured: dict[str, int] | None = None) -> dict[str, int]:
  """The 256 special tokens after `num_base` ranks: `configured` names where given, else the
  released layout shifted to start at `num_base`; `<|reserved_token_{id}|>` elsewhere."""
  named = configured or {name: num_base + i - KIMI_BASE_VOCAB for name, i in KIMI_SPECIAL_IDS.items()}
  by_id = {i: name for name, i in named.items()}
  return {by_id.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS)}


class _SpecialIds:
  """bos/eos/media/vocab_size from a `special` name -> id map."""

  def _set_specials(self, special: dict[str, int], vocab_size: int, media: bool, bos: str, eos: str):
    self.special = special
    self._names = {i: name for name, i in special.items()}
    self.bos_id, self.eos_id = special[bos], special[eos]
    self.media = special_tokens.MediaIds(*(special[n] for n in special_tokens.MEDIA_TOKENS)) if media else None
    self.vocab_size = vocab_size


class TiktokenTokenizer(_SpecialIds):
  """A tiktoken vocabulary encoded by `tiktoken` with `pattern` (Kimi's by default)."""

  def __init__(self, path: str, pattern: str = KIMI_PATTERN, media: bool = False):
    import tiktoken  # pylint: disable=import-outside-toplevel
    ranks = read_tiktoken_ranks(path)
    if sorted(ranks.values()) != list(range(len(ranks))):
      raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1} each once")
    special = kimi_specials(len(ranks), _configured_specials(os.path.dirname(os.path.abspath(path))))
    self.encoding = tiktoken.Encoding(name=os.path.basename(path), pat_str=pattern, mergeable_ranks=ranks,
                                      special_tokens=special)
    self._set_specials(special, self.encoding.n_vocab, media, special_tokens.BOS_TOKEN, special_tokens.EOS_TOKEN)

  def encode(self, text: str) -> list[int]:
    return self.encoding.encode_ordinary(text)

  def decode(self, ids: Sequence[int]) -> str:
    return special_tokens.decode_with_specials(
        ids, self._names, lambda run: self.encoding.decode_bytes(run).decode("utf-8", "replace"))


class HFTokenizer(_SpecialIds):
  """A `tokenizer.json` encoded by `tokenizers`; its added tokens are the special ones. BOS/EOS:
  `[BOS]`/`[EOS]` where present, else DeepSeek's `<｜begin▁of▁sentence｜>`/`<｜end▁of▁sentence｜>`."""

  BOS_NAMES, EOS_NAMES = (special_tokens.BOS_TOKEN, "<｜begin▁of▁sentence｜>"), (special_tokens.EOS_TOKEN, "<｜end▁of▁sentence｜>")

  def __init__(self, path: str, media: bool = False):
    import tokenizers  # pylint: disable=import-outside-toplevel
    if not os.path.isfile(path):
      raise FileNotFoundError(f"tokenizer file {path!r} does not exist (no download is attempted)")
    self.tokenizer = tokenizers.Tokenizer.from_file(path)
    self.tokenizer.encode_special_tokens = True      # a special token's name in plain text stays text
    special = {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items()}
    bos = next((n for n in self.BOS_NAMES if n in special), None)
    eos = next((n for n in self.EOS_NAMES if n in special), None)
    missing = [n for n, found in (("BOS", bos), ("EOS", eos)) if found is None]
    if missing or (media and not set(special_tokens.MEDIA_TOKENS) <= set(special)):
      raise ValueError(f"{path}: no added token for {missing or 'the media tokens'}")
    self._set_specials(special, self.tokenizer.get_vocab_size(with_added_tokens=True), media, bos, eos)

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return special_tokens.decode_with_specials(
        ids, self._names, lambda run: self.tokenizer.decode(run, skip_special_tokens=False))


def load(name: str, path: str, media: bool = False):
  """`tiktoken` / `tokenizers` from that file, or `auto`: a folder's tiktoken.model (first) or
  tokenizer.json, or a file by its name."""
  if name == "auto":
    if os.path.isdir(path):
      found = [f for f in (TIKTOKEN_FILE, TOKENIZER_JSON) if os.path.isfile(os.path.join(path, f))]
      if not found:
        raise FileNotFoundError(f"{path!r} has neither {TIKTOKEN_FILE} nor {TOKENIZER_JSON}")
      path = os.path.join(path, found[0])
    name = "tokenizers" if path.endswith(".json") else "tiktoken"
  return TiktokenTokenizer(path, media=media) if name == "tiktoken" else HFTokenizer(path, media=media)
