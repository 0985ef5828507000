"""k25jax's own chat format (not Kimi's): a Python tool, over a byte-level vocabulary plus five
role tokens. The stages still train in it; k25jax/data/chat.py is the K2.5 format that replaces it.

A conversation is BOS followed by messages, each opened by a role token and closed by
`<|end|>`:

    conversation := BOS message*
    message      := <|user|> TEXT <|end|>
                  | <|assistant|> <|call|> CODE <|end|>      a Python tool call
                  | <|assistant|> TEXT <|end|>               the final answer
                  | <|tool|> OUTPUT <|end|>                  what the call printed (or its error)

The environment writes every role token (the `<|assistant|>` that opens a turn too);
the model writes an assistant turn's body and its `<|end|>`: those are the only tokens
under the loss (mask 1), user text and tool output are context (mask 0). Sampling an
assistant turn stops at `<|end|>`.

`ChatTokenizer` puts the role tokens after a base tokenizer's vocabulary (by default the
byte tokenizer with its four media tokens, ids 259..262, so that one vocabulary serves
text-only and image conversations), leaving the base ids unchanged.
Parsing never raises on model output: `parse_turn` returns a `Turn` whose `error` is one
of `TURN_ERRORS` when the turn is malformed (the convention of `k25jax.agents.tools`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from k25jax.data import tokenizer as tokenizer_lib

ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|tool|>", "<|call|>", "<|end|>")
ROLES = ("user", "assistant", "tool")
TURN_ERRORS = (
    "truncated",     # the turn has no <|end|> (generation ran out of tokens)
    "empty",         # nothing before <|end|> (no answer, or a call with no code)
    "stray_token",   # a role token inside the body (e.g. <|call|> after text, or <|tool|>)
)


class ChatTokenizer:
  """`base` (default `ByteTokenizer(media=True)`) plus the role tokens, ids base.vocab_size + i.
  `media` is the base's media ids (None without them)."""

  def __init__(self, base: tokenizer_lib.Tokenizer | None = None):
    self.base = base if base is not None else tokenizer_lib.ByteTokenizer(media=True)
    self.media = getattr(self.base, "media", None)
    start = self.base.vocab_size
    self.special = {name: start + i for i, name in enumerate(ROLE_TOKENS)}
    self.user_id, self.assistant_id, self.tool_id, self.call_id, self.end_id = (
        self.special[name] for name in ROLE_TOKENS)
    self.vocab_size = start + len(ROLE_TOKENS)
    self.bos_id, self.eos_id, self.pad_id = self.base.bos_id, self.base.eos_id, tokenizer_lib.PAD_ID
    self._names = {i: name for name, i in self.special.items()}

  def encode(self, text: str) -> list[int]:
    return self.base.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`, role tokens written by name (base decoding between them)."""
    out, run = [], []
    for i in (int(i) for i in ids):
      if i in self._names:
        out += [self.base.decode(run), self._names[i]]
        run = []
      else:
        run.append(i)
    return "".join(out + [self.base.decode(run)])


@dataclasses.dataclass(frozen=True)
class Message:
  """One message: role ∈ ROLES; for the assistant, `call` says the content is tool code.
  `prefix` are token ids placed before the content (e.g. a media block in a user turn)."""

  role: str
  content: str
  call: bool = False
  prefix: tuple[int, ...] = ()

  def __post_init__(self):
    if self.role not in ROLES:
      raise ValueError(f"Message.role={self.role!r}; choose one of {ROLES}")
    if self.call and self.role != "assistant":
      raise ValueError(f"Message.call=True needs role 'assistant', got {self.role!r}")


def header(tok: ChatTokenizer, role: str) -> int:
  return {"user": tok.user_id, "assistant": tok.assistant_id, "tool": tok.tool_id}[role]


def message_tokens(tok: ChatTokenizer, message: Message) -> tuple[list[int], list[float]]:
  """`role [prefix] [<|call|>] content <|end|>` and its loss mask (1 on what the assistant writes)."""
  body = ([tok.call_id] if message.call else []) + tok.encode(message.content) + [tok.end_id]
  learned = 1.0 if message.role == "assistant" else 0.0
  tokens = [header(tok, message.role), *message.prefix, *body]
  return tokens, [0.0] * (1 + len(message.prefix)) + [learned] * len(body)


def render(tok: ChatTokenizer, messages: Sequence[Message]) -> tuple[list[int], list[float]]:
  """BOS + messages → (tokens, loss mask): mask 1 exactly on assistant bodies and their <|end|>."""
  tokens, mask = [tok.bos_id], [0.0]
  for message in messages:
    t, m = message_tokens(tok, message)
    tokens += t
    mask += m
  return tokens, mask


@dataclasses.dataclass(frozen=True)
class Turn:
  """A parsed assistant turn: `call` (code to run) or an answer; `error` ∈ TURN_ERRORS or None.
  `tokens` is the turn through its <|end|> (all of it when truncated)."""

  text: str
  call: bool
  error: str | None
  tokens: tuple[int, ...]


def parse_turn(tok: ChatTokenizer, ids: Sequence[int]) -> Turn:
  """Parses the tokens a model generated after `<|assistant|>` (anything after the first
  `<|end|>` is ignored). Never raises on model output."""
  ids = [int(i) for i in ids]
  if tok.end_id not in ids:
    return Turn(tok.decode(ids), False, "truncated", tuple(ids))
  end = ids.index(tok.end_id)
  body = ids[:end]
  call = bool(body) and body[0] == tok.call_id
  content = body[1:] if call else body
  if any(i in tok.special.values() for i in content):
    return Turn(tok.decode(content), call, "stray_token", tuple(ids[:end + 1]))
  text = tok.decode(content)
  if not text.strip():
    return Turn(text, call, "empty", tuple(ids[:end + 1]))
  return Turn(text, call, None, tuple(ids[:end + 1]))


def tool_output(result, max_chars: int) -> str:
  """A tool result (`sandbox.RunResult`) as the text of its tool message: stdout (and the last
  expression's value, if any), or `Error: ...`; cut to `max_chars`, marked "..."."""
  if result.ok:
    text = result.stdout.rstrip("\n")
    if result.value is not None:
      text = f"{text}\n{result.value}" if text else str(result.value)
  else:
    text = f"Error: {result.error}"
  return text if len(text) <= max_chars else text[:max_chars - 3] + "..."
