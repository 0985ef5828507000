"""Renderings of the wide-search protocol: what the model reads and writes for the same episode.

The episode is structured data (`tools`: calls, observations, prompts) with one text form,
the DSL's readable text (`dsl.decode`, e.g. `orch B4 A2 E1 E5 E7`). A rendering turns that
text into a model's token ids and reads the model's turns back into it; the environment,
the scripted policies and the scores work on the text form alone, so both renderings play
the same episode to the same result.

`DSLRendering` (the 91-id vocabulary of `dsl`, one id a word; the fast CPU preset):

    prompt  := orch B4 A2 E1 E5 E7 |         observation := obs E1 V3 |
    turn    := search A2 next |              (the model writes the turn, `|` included)

`ChatRendering` (k25jax's own chat format through `data.legacy_chat.ChatTokenizer`: bytes, media and
role tokens, 268 ids; the vocabulary of every other stage of the tiny K2.5 model):

    context     := BOS <|user|> TEXT <|end|> <|assistant|>  (turn <|tool|> TEXT <|end|> <|assistant|>)*
    turn        := <|call|> TEXT <|end|>      calls (create, assign, search)
                 | TEXT <|end|>               an answer turn (`answer ...`)

TEXT is the block's readable text without its `|`, bytes through the tokenizer. The
environment writes the role headers (the `<|assistant|>` that opens each turn too), the
model the body and its `<|end|>`, as in `data.legacy_chat`. Reading a turn back: the words of its
text are DSL tokens; a word that is none reads as `_` (`dsl.PAD`), which no call accepts,
so it becomes an `unknown_tool` or `arg_type` error of its call and the rest of the turn
still runs. `<|call|>` is a marker the model is taught to write; reading ignores whether
it was there. A role token inside the body makes the turn one error (`_ |`); an empty body
is an empty turn (`|`); no `<|end|>` is a truncated turn.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from k25jax.agents import dsl
from k25jax.agents.widesearch.k25_rendering import K25Rendering
from k25jax.agents.widesearch.tasks import MAX_CONTEXT
from k25jax.data import legacy_chat as chat

NAMES = ("dsl", "chat", "k2.5")


class Rendering(Protocol):
  """name, vocab_size, pad_id, stop_id (the id that ends a generated turn), max_context (ids
  an agent context can reach: a wide task of 24 entities or a budget of 16), and:"""

  name: str
  vocab_size: int
  pad_id: int
  stop_id: int
  max_context: int

  def prompt(self, block: Sequence[int]) -> list[int]:
    """A context's first block (DSL ids ending with `|`) as the model reads it, up to its first turn."""

  def observation(self, block: Sequence[int], turn: Sequence[int] = ()) -> list[int]:
    """An observation block as the model reads it, up to the next turn; `turn`: the
    generated ids of the turn it answers."""

  def turn(self, block: Sequence[int]) -> list[int]:
    """A DSL turn (ending with `|`) as the model would write it (scripted policies' turns)."""

  def read_turn(self, generated: Sequence[int]) -> tuple[list[int], list[int]]:
    """(the generated ids through the turn's stop, or all of them without it; the turn's DSL ids)."""

  def close(self) -> list[int]:
    """What the environment writes after a truncated turn, to close it."""

  def choice_offset(self, turn: Sequence[int]) -> int:
    """The position in a generated turn of its first decision (e.g. `create` or `search`)."""


def _text(block: Sequence[int]) -> str:
  return dsl.decode(dsl.block_body(block))


class DSLRendering:
  """The DSL's own ids: every block as it is."""

  name = "dsl"
  vocab_size = dsl.VOCAB_SIZE
  pad_id = dsl.PAD_ID
  stop_id = dsl.EOT_ID
  max_context = MAX_CONTEXT

  def prompt(self, block):
    return [int(t) for t in block]

  turn = prompt

  def observation(self, block, turn=()):
    return self.prompt(block)

  def read_turn(self, generated):
    generated = [int(t) for t in generated]
    if dsl.EOT_ID in generated:
      generated = generated[:generated.index(dsl.EOT_ID) + 1]
    return generated, list(generated)

  def close(self):
    return [dsl.EOT_ID]

  def choice_offset(self, turn):
    return 0


class ChatRendering:
  """k25jax's own chat format (module docstring) over `tokenizer` (default: bytes + media + roles)."""

  name = "chat"
  max_context = 640   # the longest scripted context seen is ~520 ids (budget 16), a turn at most 80

  def __init__(self, tokenizer: chat.ChatTokenizer | None = None):
    self.tok = tokenizer if tokenizer is not None else chat.ChatTokenizer()
    self.vocab_size = self.tok.vocab_size
    self.pad_id = self.tok.pad_id
    self.stop_id = self.tok.end_id

  def prompt(self, block):
    return [self.tok.bos_id, self.tok.user_id, *self.tok.encode(_text(block)), self.tok.end_id, self.tok.assistant_id]

  def observation(self, block, turn=()):
    return [self.tok.tool_id, *self.tok.encode(_text(block)), self.tok.end_id, self.tok.assistant_id]

  def turn(self, block):
    text = _text(block)
    answers = dsl.ANSWER_ID in [int(t) for t in block]
    return [*([] if answers else [self.tok.call_id]), *self.tok.encode(text), self.tok.end_id]

  def read_turn(self, generated):
    parsed = chat.parse_turn(self.tok, generated)
    if parsed.error == "stray_token":
      return list(parsed.tokens), [dsl.PAD_ID, dsl.EOT_ID]
    words = [dsl.TOKEN_ID.get(word, dsl.PAD_ID) for word in parsed.text.split()]
    return list(parsed.tokens), words if parsed.error == "truncated" else [*words, dsl.EOT_ID]

  def close(self):
    return [self.tok.end_id]

  def choice_offset(self, turn):
    """After the `<|call|>` marker, the first byte of the call (`c` of `create`)."""
    return int(list(turn[:1]) == [self.tok.call_id])


def make(name: str) -> Rendering:
  """The rendering called `name` (one of NAMES)."""
  if name == "dsl":
    return DSLRendering()
  if name == "chat":
    return ChatRendering()
  if name == "k2.5":
    return K25Rendering()
  raise ValueError(f"rendering {name!r}; choose one of {NAMES}")
