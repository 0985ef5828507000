"""The format a checkpoint's model reads prompts in, chosen from its tokenizer, for tools that
talk to a checkpoint (k25jax.generate):

    tokenizer has                      format    prompt                                           stops at
    the K2.5 chat tokens (<|im_*|>)    "k2.5"    chat.render_ids(messages, generation prompt)     <|im_end|>
    k25jax's own role tokens           "legacy"  legacy_chat.render(messages) + <|assistant|>     <|end|>
    neither (a pre-training run)       "text"    BOS + the last user message's text, continued    EOS

The legacy and text formats have no system turn (a system message is an error); the text
format continues the last user message alone. An image (a `vision.Media`) goes with the
last user message: an image part of `tokens` placeholders before its text (K2.5), the media
block before its text (legacy and text).
`reply(ids)` reads what the model wrote back as text, and never raises on model output.

A run's tokenizer is recorded in its workdir as `{"name", "path", "media"}` (`tokenizer.load`'s
arguments), with `"chat": "legacy"` for the stages that train in k25jax's own chat format
(`LEGACY_RECORD`) and `"chat": "k2.5"` for the K2.5 format (the byte tokenizer with its chat
tokens; Kimi's vocabularies have them already): `tokenizer_from_record` rebuilds it.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from k25jax.data import chat, legacy_chat, tokenizer as tokenizer_lib
from k25jax.data.vision import Media, media_token_ids

LEGACY_RECORD = {"name": "bytes", "path": "", "media": True, "chat": "legacy"}
K25_RECORD = {"name": "bytes", "path": "", "media": True, "chat": "k2.5"}


def record_of(tok) -> dict | None:
  """The model record of a stage's tokenizer when it is the legacy chat tokenizer (bytes,
  media, role tokens: `LEGACY_RECORD`) or the byte tokenizer with media and the K2.5 chat
  tokens (`K25_RECORD`); None for the others a stage builds itself (the compact addition
  and PARL DSL vocabularies, which no tool outside their stage reads)."""
  if isinstance(tok, legacy_chat.ChatTokenizer) and isinstance(tok.base, tokenizer_lib.ByteTokenizer) and tok.media:
    return dict(LEGACY_RECORD)
  if isinstance(tok, tokenizer_lib.ByteTokenizer) and tok.media and chat.IM_MIDDLE in tok.special:
    return dict(K25_RECORD)
  return None


def tokenizer_from_record(record: dict):
  """The tokenizer a run's model record names (module docstring)."""
  kind = record.get("chat")
  if kind not in (None, "legacy", "k2.5"):
    raise ValueError(f"a tokenizer record with chat={kind!r}; k25jax knows 'legacy' and 'k2.5'")
  base = tokenizer_lib.load(record["name"], record.get("path", ""), media=bool(record.get("media")),
                            chat=kind == "k2.5" and record["name"] == "bytes")
  return legacy_chat.ChatTokenizer(base) if kind == "legacy" else base


def as_legacy(tok):
  """`tok` as the legacy chat tokenizer when it holds the role tokens at their ids (an HF
  folder exported from a legacy-format run), else `tok` unchanged."""
  if "<|end|>" not in tok.special:
    return tok
  legacy = legacy_chat.ChatTokenizer()
  wrong = [f"{name} {tok.special.get(name)} (expected {i})" for name, i in legacy.special.items()
           if tok.special.get(name) != i]
  if wrong or tok.vocab_size != legacy.vocab_size:
    raise ValueError(f"the tokenizer has k25jax's legacy role tokens at other ids than the legacy chat "
                     f"tokenizer's ({'; '.join(wrong) or f'vocab {tok.vocab_size}, not {legacy.vocab_size}'})")
  return legacy


@dataclasses.dataclass(frozen=True)
class Reply:
  text: str
  error: str | None       # the format's turn error (e.g. "truncated"), or None


def _last_user(messages: Sequence[dict]) -> int:
  users = [i for i, m in enumerate(messages) if m["role"] == "user"]
  if not users:
    raise ValueError("the conversation has no user message")
  return users[-1]


class K25Format:
  name = "k2.5"

  def __init__(self, tok):
    self.tok = tok
    self.stop_ids = (tok.special[chat.IM_END],)

  def prompt(self, messages: Sequence[dict], image: Media | None = None) -> list[int]:
    messages = [dict(m) for m in messages]
    if image is not None:
      last = messages[_last_user(messages)]
      last["content"] = [{"type": "image", "tokens": image.num_tokens}, {"type": "text", "text": last["content"]}]
    return chat.render_ids(self.tok, messages, add_generation_prompt=True)[0]

  def reply(self, ids: Sequence[int]) -> Reply:
    turn = chat.parse_assistant(self.tok, ids)
    text = turn.content + "".join(f"\n[call {c.name}({c.arguments})]" for c in turn.tool_calls)
    return Reply(text, turn.error)


class LegacyFormat:
  name = "legacy"

  def __init__(self, tok: legacy_chat.ChatTokenizer):
    self.tok = tok
    self.stop_ids = (tok.end_id,)

  def prompt(self, messages: Sequence[dict], image: Media | None = None) -> list[int]:
    if any(m["role"] == "system" for m in messages):
      raise ValueError("k25jax's legacy chat format has no system turn")
    last = _last_user(messages)
    prefix = tuple(media_token_ids(image, self.tok)) if image is not None else ()
    rendered = [legacy_chat.Message(m["role"], m["content"], prefix=prefix if i == last else ())
                for i, m in enumerate(messages)]
    return legacy_chat.render(self.tok, rendered)[0] + [self.tok.assistant_id]

  def reply(self, ids: Sequence[int]) -> Reply:
    turn = legacy_chat.parse_turn(self.tok, ids)
    return Reply(("[call]\n" if turn.call else "") + turn.text, turn.error)


class TextFormat:
  name = "text"

  def __init__(self, tok):
    self.tok = tok
    self.stop_ids = (tok.eos_id,)

  def prompt(self, messages: Sequence[dict], image: Media | None = None) -> list[int]:
    if any(m["role"] == "system" for m in messages):
      raise ValueError("a pre-training model (the text format) has no system turn: it continues the prompt")
    prefix = media_token_ids(image, self.tok) if image is not None else []
    return [self.tok.bos_id, *prefix, *self.tok.encode(messages[_last_user(messages)]["content"])]

  def reply(self, ids: Sequence[int]) -> Reply:
    ids = [int(i) for i in ids]
    done = self.tok.eos_id in ids
    return Reply(self.tok.decode(ids[:ids.index(self.tok.eos_id)] if done else ids), None if done else "truncated")


def for_tokenizer(tok):
  """The format `tok` speaks (module docstring)."""
  if chat.IM_MIDDLE in tok.special:
    return K25Format(tok)
  if isinstance(tok, legacy_chat.ChatTokenizer):
    return LegacyFormat(tok)
  return TextFormat(tok)
