"""The chat format of an episode with the Python tool: k25jax's legacy format or Kimi K2.5's.

                legacy (`legacy_chat`)                 k2.5 (`chat`, the tool declared as `python`)
    prompt      BOS <|user|> [media] Q <|end|>         <|im_system|>tool_declare<|im_middle|>{python}<|im_end|>
                <|assistant|>                          <|im_system|>system<|im_middle|><|im_end|>
                                                       <|im_user|>user<|im_middle|>[image]Q<|im_end|>
                                                       <|im_assistant|>assistant<|im_middle|><think></think>
    a call      <|call|> CODE <|end|>                  <|tool_calls_section_begin|><|tool_call_begin|>
                                                       functions.python:{k}<|tool_call_argument_begin|>
                                                       {"code": CODE}<|tool_call_end|>...<|tool_calls_section_end|>
                                                       <|im_end|>
    its result  <|tool|> OUTPUT <|end|> <|assistant|>  <|im_system|>tool<|im_middle|>## Return of
                                                       functions.python:{k}\\nOUTPUT<|im_end|>, then the
                                                       generation prompt
    the answer  TEXT <|end|>                           TEXT <|im_end|>

In the K2.5 format the system turn is empty (the template's 52-byte default would not fit the
tiny models' contexts), thinking is off, the tool is declared without a description, a turn
may make several calls (each gets its own result, in order, under the id the model wrote),
and in the trajectories the k-th call of an episode is `functions.python:{k}`. Both formats give the model the same trajectories (`trajectory`):
the loss mask is 1 on exactly what the model writes. `parse` reads a sampled turn and never
raises: a malformed call is a `ToolTurn` with `malformed_call` and its `error`, which the
rollout answers with an error observation; an answer that does not parse has `answer` None.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from k25jax.data import chat, legacy_chat, tokenizer as tokenizer_lib
from k25jax.data.vision import Media, media_token_ids

NAMES = ("legacy", "k2.5")
PYTHON_TOOL = {"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


@dataclasses.dataclass(frozen=True)
class ToolTurn:
  """A sampled assistant turn: `tokens` through its stop token (all of them when truncated);
  `calls` the code of each call and `call_ids` their ids; `answer` the text of an answer
  (None for a call or a turn that does not parse); `error`: "truncated", a malformed call's
  fault (`malformed_call`), or an answer's."""

  tokens: tuple[int, ...]
  calls: tuple[str, ...] = ()
  call_ids: tuple[str, ...] = ()
  answer: str | None = None
  error: str | None = None
  malformed_call: bool = False

  @property
  def is_call(self) -> bool:
    return bool(self.calls) or self.malformed_call


class LegacyToolFormat:
  name = "legacy"

  def __init__(self):
    self.tokenizer = legacy_chat.ChatTokenizer()
    self.stop_id, self.pad_id = self.tokenizer.end_id, self.tokenizer.pad_id

  def prompt(self, question: str, media: Media | None = None) -> list[int]:
    prefix = tuple(media_token_ids(media, self.tokenizer)) if media is not None else ()
    return legacy_chat.render(self.tokenizer, [legacy_chat.Message("user", question, prefix=prefix)])[0] + [
        self.tokenizer.assistant_id]

  def trajectory(self, question: str, steps: Sequence[tuple[str, str]], answer: str,
                 media: Media | None = None) -> tuple[list[int], list[float]]:
    """(ids, loss mask) of question → (code, output) per step → answer."""
    prefix = tuple(media_token_ids(media, self.tokenizer)) if media is not None else ()
    messages = [legacy_chat.Message("user", question, prefix=prefix)]
    for code, output in steps:
      messages += [legacy_chat.Message("assistant", code, call=True), legacy_chat.Message("tool", output)]
    return legacy_chat.render(self.tokenizer, messages + [legacy_chat.Message("assistant", answer)])

  def parse(self, ids: Sequence[int]) -> ToolTurn:
    turn = legacy_chat.parse_turn(self.tokenizer, ids)
    tokens = tuple(turn.tokens)
    if turn.error == "truncated":
      return ToolTurn(tokens, error="truncated")
    if turn.call:
      return ToolTurn(tokens, error=turn.error, malformed_call=True) if turn.error else ToolTurn(
          tokens, (turn.text,), ("",))
    return ToolTurn(tokens, answer=None if turn.error else turn.text.strip(), error=turn.error)

  def results(self, turn: ToolTurn, outputs: Sequence[str]) -> list[int]:
    """The ids after a call turn: its result (a legacy turn makes one call), then the next
    turn's opening."""
    ids, _ = legacy_chat.message_tokens(self.tokenizer, legacy_chat.Message("tool", "\n".join(outputs)))
    return ids + [self.tokenizer.assistant_id]


class K25ToolFormat:
  name = "k2.5"

  def __init__(self):
    self.tokenizer = tokenizer_lib.ByteTokenizer(media=True, chat=True)
    self.stop_id, self.pad_id = self.tokenizer.special[chat.IM_END], tokenizer_lib.PAD_ID

  @staticmethod
  def _user(question: str, media: Media | None) -> dict:
    content = question if media is None else [{"type": "image", "tokens": media.num_tokens},
                                              {"type": "text", "text": question}]
    return {"role": "user", "content": content}

  def prompt(self, question: str, media: Media | None = None) -> list[int]:
    return chat.render_ids(self.tokenizer, [chat.EMPTY_SYSTEM, self._user(question, media)], [PYTHON_TOOL],
                           add_generation_prompt=True)[0]

  @staticmethod
  def call_id(k: int) -> str:
    return f"functions.python:{k}"

  def trajectory(self, question: str, steps: Sequence[tuple[str, str]], answer: str,
                 media: Media | None = None) -> tuple[list[int], list[float]]:
    """(ids, loss mask) of question → one call a step, its result → answer."""
    messages = [chat.EMPTY_SYSTEM, self._user(question, media)]
    for k, (code, output) in enumerate(steps):
      call = {"id": self.call_id(k), "type": "function", "function": {"name": "python", "arguments": {"code": code}}}
      messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": self.call_id(k), "content": output}]
    messages.append({"role": "assistant", "content": answer})
    return chat.render_ids(self.tokenizer, messages, [PYTHON_TOOL])

  def parse(self, ids: Sequence[int]) -> ToolTurn:
    turn = chat.parse_assistant(self.tokenizer, ids, tools=[PYTHON_TOOL])
    tokens = tuple(turn.tokens)
    if turn.error == "truncated":
      return ToolTurn(tokens, error="truncated")
    if turn.error:
      section = self.tokenizer.special[chat.SECTION_BEGIN] in tokens
      return ToolTurn(tokens, error=turn.error, malformed_call=section)
    if turn.tool_calls:
      codes = [c.arguments.get("code") for c in turn.tool_calls]
      if not all(isinstance(code, str) and code.strip() for code in codes):
        return ToolTurn(tokens, error="no_code", malformed_call=True)
      return ToolTurn(tokens, tuple(codes), tuple(c.id for c in turn.tool_calls))
    return ToolTurn(tokens, answer=turn.content.strip())

  def results(self, turn: ToolTurn, outputs: Sequence[str]) -> list[int]:
    """The ids after a call turn: one result per call, under the id the model gave it (a
    malformed turn's single error result: `functions.python:0`), then the generation prompt."""
    ids = turn.call_ids or (self.call_id(0),) * len(outputs)
    messages = [{"role": "tool", "tool_call_id": call_id, "content": output} for call_id, output in zip(ids, outputs)]
    return chat.continuation_ids(self.tokenizer, messages)


def get(name: str):
  """The tool format called `name` (NAMES)."""
  if name not in NAMES:
    raise ValueError(f"chat format {name!r}; choose one of {NAMES}")
  return LegacyToolFormat() if name == "legacy" else K25ToolFormat()
