"""Tokenizers: raw bytes (the tiny presets), and the files a checkpoint ships, encoded by the
libraries that own them: a tiktoken vocabulary (Kimi's `tiktoken.model`, through `tiktoken`)
or an HF `tokenizer.json` (DeepSeek-V3-family folders, through `tokenizers`); see
k25jax/data/tokenizer_files.py.

Every tokenizer has `vocab_size`, `bos_id`, `eos_id`, `media` (the four media ids or None),
`special` (name -> id of its special tokens), `encode(text)` (plain text: a special token's
name inside the text is encoded as text, never as the token) and `decode(ids)` (special
tokens written by name). Packed rows pad with id 0 (`PAD_ID`); padding is never a target
(the loss mask is 0 there), so with a BPE vocabulary id 0 may double as a real token.

With `media=True` a tokenizer has the four media tokens of K2.5 (see k25jax/data/vision.py);
with `chat=True` also the tokens of the K2.5 chat format (`CHAT_TOKENS`, k25jax/data/chat.py).
The byte tokenizer appends them after its bytes: media 259..262, then the chat tokens
263..274, so that tiny runs speak Kimi's format with Kimi's token names.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from k25jax.data.special_tokens import (BOS_TOKEN, CHAT_TOKENS, EOS_TOKEN, MEDIA_TOKENS,  # noqa: F401
                                        MediaIds, decode_with_specials)

PAD_ID = 0


class Tokenizer(Protocol):
  vocab_size: int
  bos_id: int
  eos_id: int
  media: MediaIds | None
  special: dict[str, int]

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes: byte b -> id b + 3; 0 = PAD, 1 = BOS, 2 = EOS; vocab 259. `media` appends
  the media tokens (259..262, vocab 263), `chat` (which needs `media`) the chat tokens after
  them (263..274, vocab 275)."""

  offset = 3
  bos_id = 1
  eos_id = 2

  def __init__(self, media: bool = False, chat: bool = False):
    if chat and not media:
      raise ValueError("ByteTokenizer(chat=True) needs media=True: the K2.5 vocabulary has both")
    first = 256 + self.offset
    self.media = MediaIds(*range(first, first + 4)) if media else None
    names = (MEDIA_TOKENS if media else ()) + (CHAT_TOKENS if chat else ())
    self.special = {BOS_TOKEN: self.bos_id, EOS_TOKEN: self.eos_id,
                    **{name: first + k for k, name in enumerate(names)}}
    self.vocab_size = first + len(names)
    self._names = {i: name for name, i in self.special.items() if i >= first}   # BOS/EOS decode to nothing

  def encode(self, text: str) -> list[int]:
    return [b + self.offset for b in text.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    return decode_with_specials(ids, self._names, self.decode_bytes)

  def decode_bytes(self, ids: Sequence[int]) -> str:
    return bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < 256 + self.offset).decode(
        "utf-8", "replace")


def load(name: str, path: str = "", media: bool = False, chat: bool = False) -> Tokenizer:
  """`bytes` (default); `tiktoken` (`path`: a tiktoken vocabulary file), `tokenizers` (`path`:
  a tokenizer.json) or `auto` (`path`: a checkpoint folder, or one of those files)."""
  if name == "bytes":
    return ByteTokenizer(media, chat)
  from k25jax.data import tokenizer_files  # pylint: disable=import-outside-toplevel  (tiktoken, tokenizers)
  if name not in ("tiktoken", "tokenizers", "auto"):
    raise ValueError(f"data.tokenizer={name!r}; choose 'bytes', 'tiktoken', 'tokenizers' or 'auto'")
  if not path:
    raise ValueError(f"data.tokenizer={name!r} needs data.vocab_file (a local tokenizer file or checkpoint folder)")
  return tokenizer_files.load(name, path, media=media)
