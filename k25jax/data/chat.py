"""The K2.5 chat format: what Kimi K2.5's chat template renders, to text and to ids.

    [<|im_system|>tool_declare<|im_middle|>{tools, k25jax/data/tool_declaration.py}<|im_end|>]
    <|im_system|>system<|im_middle|>{system prompt; DEFAULT_SYSTEM when there is none}<|im_end|>
    <|im_user|>{name|user}<|im_middle|>{content}<|im_end|>
    <|im_assistant|>{name|assistant}<|im_middle|><think>{reasoning}</think>{content}{calls}<|im_end|>
    <|im_system|>{name|tool}<|im_middle|>## Return of {tool_call_id}\\n{content}<|im_end|>
    ...
    <|im_assistant|>assistant<|im_middle|><think>          the generation prompt, thinking on
    <|im_assistant|>assistant<|im_middle|><think></think>  the generation prompt, thinking off

    calls := <|tool_calls_section_begin|>
               (<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{JSON}<|tool_call_end|>)+
             <|tool_calls_section_end|>
    image  := <|media_begin|>image<|media_content|><|media_pad|><|media_end|>\\n

Messages are OpenAI-shaped dicts: `role` (system, user, assistant, tool), `content` (text,
or a list of `{"type": "text", "text"}` and `{"type": "image", "tokens": n}` parts),
`name`, an assistant's `reasoning_content` and `tool_calls` (`{"id", "function": {"name",
"arguments"}}`, arguments a JSON string or a dict), a tool result's `tool_call_id`.

Thinking: assistant messages up to the last one without tool calls are history and keep an
empty `<think></think>`; later ones (the current round: the calls and results since) keep
their reasoning. As in the template, with two exceptions that keep every prompt a prefix of
its conversation (what RL samples is what it trains on): the final message of a training
example (an assistant answer) belongs to the current round, so its reasoning is trained
on; and with thinking off no reasoning is rendered (the prompt ends `<think></think>`).

`render_ids` encodes the same text with a tokenizer that has the chat tokens (loss mask 1 on
exactly what the model writes after the generation prompt: reasoning, `</think>` when
thinking, content, calls and `<|im_end|>`); an image's `<|media_pad|>` is repeated `tokens`
times (its patches after merging). `parse_assistant` reads sampled ids back into a turn and
never raises on model output: malformed output is a turn whose `error` names the fault.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Sequence

from k25jax.data import tool_declaration
from k25jax.data.tokenizer import MEDIA_TOKENS, Tokenizer

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
EMPTY_SYSTEM = {"role": "system", "content": ""}   # a system turn without a prompt: no DEFAULT_SYSTEM inserted
ROLES = ("system", "user", "assistant", "tool")
IM_END, IM_MIDDLE = "<|im_end|>", "<|im_middle|>"
HEADERS = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>", "tool": "<|im_system|>"}
THINK, END_THINK = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
CALL_ID = re.compile(r"functions\.([A-Za-z_][\w\-.]*):(\d+)")
TEMPLATE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_template.jinja")
TURN_ERRORS = (
    "truncated",             # no <|im_end|> (generation ran out of tokens)
    "unfinished_thinking",   # thinking on and no </think> before <|im_end|>
    "stray_token",           # a special token an assistant never writes there (a role, media, <think>, ...)
    "unclosed_section",      # <|tool_calls_section_begin|> without its end
    "empty_section",         # a section with no call
    "malformed_call",        # text between calls, or a call missing its argument marker or end
    "bad_call_id",           # not functions.{name}:{index}
    "bad_arguments",         # the arguments are not JSON
    "arguments_not_object",  # JSON, but not an object
    "unknown_tool",          # a name that the declared tools do not have
    "text_after_calls",      # anything between the section's end and <|im_end|>
    "empty",                 # no content and no call
)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  id: str
  name: str
  arguments: dict


@dataclasses.dataclass(frozen=True)
class Turn:
  """A parsed assistant turn; `error` ∈ TURN_ERRORS or None; `tokens` through <|im_end|>
  (all of them when truncated)."""

  content: str
  reasoning: str
  tool_calls: tuple[ToolCall, ...]
  error: str | None
  tokens: tuple[int, ...]

  def message(self) -> dict:
    """The turn as an assistant message (what render_text takes)."""
    out: dict[str, Any] = {"role": "assistant", "content": self.content}
    if self.reasoning:
      out["reasoning_content"] = self.reasoning
    if self.tool_calls:
      out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in self.tool_calls]
    return out


def chat_template() -> str:
  """This format as a transformers chat template (Jinja): `apply_chat_template(messages, tools=...,
  tools_ts_str=tool_declaration.declare(tools), thinking=..., add_generation_prompt=...)`
  renders what render_text does."""
  with open(TEMPLATE_FILE) as f:
    return f.read()


# A rendered conversation is a list of segments: (text, special, learned).
Segment = tuple[str, bool, bool]


def _content_segments(content, learned: bool) -> list[Segment]:
  if isinstance(content, str):
    return [(content, False, learned)]
  out = []
  for part in content:
    kind = part.get("type")
    if kind == "text":
      out.append((part["text"], False, learned))
    elif kind in ("image", "image_url"):
      pads = int(part.get("tokens", 1))
      if pads < 1:
        raise ValueError(f"an image part needs tokens >= 1, got {pads}")
      out += [(MEDIA_TOKENS.begin, True, False), ("image", False, False), (MEDIA_TOKENS.content, True, False)]
      out += [(MEDIA_TOKENS.pad, True, False)] * pads + [(MEDIA_TOKENS.end, True, False), ("\n", False, False)]
    else:
      raise ValueError(f"content part type {kind!r}; choose 'text' or 'image'")
  return out


def _arguments(arguments) -> str:
  return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _calls_segments(calls: Sequence[dict]) -> list[Segment]:
  out = [(SECTION_BEGIN, True, True)]
  for index, call in enumerate(calls):
    function = call["function"]
    call_id = call.get("id") or f"functions.{function['name']}:{index}"
    out += [(CALL_BEGIN, True, True), (call_id, False, True), (ARGUMENT_BEGIN, True, True),
            (_arguments(function["arguments"]), False, True), (CALL_END, True, True)]
  return out + [(SECTION_END, True, True)]


def _check(message: dict):
  role = message.get("role")
  if role not in ROLES:
    raise ValueError(f"message role {role!r}; choose one of {ROLES}")
  if role == "tool" and not message.get("tool_call_id"):
    raise ValueError("a tool message needs the tool_call_id of the call it answers")
  if message.get("tool_calls") and role != "assistant":
    raise ValueError(f"only assistant messages make tool calls, not {role!r}")


def _history_end(messages: Sequence[dict]) -> int:
  """Messages before this index are history: through the last assistant message without
  calls (the final message of a training example excluded)."""
  last = len(messages) - 1 if messages and messages[-1]["role"] == "assistant" else len(messages)
  for i in range(last - 1, -1, -1):
    if messages[i]["role"] == "assistant" and not messages[i].get("tool_calls"):
      return i + 1
  return 0


def _message_segments(message: dict, thinking: bool, current: bool) -> list[Segment]:
  """One message's segments; `current`: an assistant message of the current round (its
  reasoning kept when thinking)."""
  role = message["role"]
  learned = role == "assistant"
  out = [(HEADERS[role], True, False), (message.get("name") or role, False, False), (IM_MIDDLE, True, False)]
  if role == "tool":
    out.append((f"## Return of {message['tool_call_id']}\n", False, False))
  if role == "assistant":
    reasoning = (message.get("reasoning_content") or "") if thinking and current else ""
    out += [(THINK, True, False), (reasoning, False, True), (END_THINK, True, thinking)]
  out += _content_segments(message.get("content") or "", learned)
  if message.get("tool_calls"):
    out += _calls_segments(message["tool_calls"])
  out.append((IM_END, True, learned))
  return out


def _generation_prompt(thinking: bool) -> list[Segment]:
  out = [(HEADERS["assistant"], True, False), ("assistant", False, False), (IM_MIDDLE, True, False),
         (THINK, True, False)]
  return out if thinking else out + [(END_THINK, True, False)]


def segments(messages: Sequence[dict], tools: Sequence[dict] | None = None, thinking: bool = False,
             add_generation_prompt: bool = False) -> list[Segment]:
  """The conversation as (text, special, learned) segments, in order."""
  for message in messages:
    _check(message)
  out: list[Segment] = []
  declared = tool_declaration.declare(list(tools)) if tools else ""
  if declared:
    out += [(HEADERS["system"], True, False), ("tool_declare", False, False), (IM_MIDDLE, True, False),
            (declared, False, False), (IM_END, True, False)]
  if not messages or messages[0]["role"] != "system":
    out += [(HEADERS["system"], True, False), ("system", False, False), (IM_MIDDLE, True, False),
            (DEFAULT_SYSTEM, False, False), (IM_END, True, False)]
  history = _history_end(messages)
  for index, message in enumerate(messages):
    out += _message_segments(message, thinking, index >= history)
  return out + (_generation_prompt(thinking) if add_generation_prompt else [])


def render_text(messages: Sequence[dict], tools: Sequence[dict] | None = None, thinking: bool = False,
                add_generation_prompt: bool = False) -> str:
  """The conversation as the chat template's text."""
  return "".join(text for text, _, _ in segments(messages, tools, thinking, add_generation_prompt))


def _ids(tok: Tokenizer, segs: Sequence[Segment]) -> tuple[list[int], list[float]]:
  """(ids, loss mask) of segments: the text between special tokens encoded as one piece (as a
  tokenizer reads the whole string), mask 1 on the learned segments."""
  missing = [n for n in (IM_END, IM_MIDDLE, THINK, SECTION_BEGIN) if n not in tok.special]
  if missing:
    raise ValueError(f"the tokenizer has no chat tokens ({missing[0]}...): use one with chat=True or a Kimi vocabulary")
  ids: list[int] = []
  mask: list[float] = []
  run, run_learned = "", False

  def flush():
    pieces = tok.encode(run) if run else []
    ids.extend(pieces)
    mask.extend([float(run_learned)] * len(pieces))

  for text, special, learned in segs:
    if special:
      flush()
      run = ""
      ids.append(tok.special[text])
      mask.append(float(learned))
    elif text:
      if run and learned != run_learned:
        flush()
        run = ""
      run, run_learned = run + text, learned
  flush()
  return ids, mask


def render_ids(tok: Tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
               thinking: bool = False, add_generation_prompt: bool = False) -> tuple[list[int], list[float]]:
  """(ids, loss mask) of render_text's conversation (`_ids`: mask 1 on what the model writes)."""
  return _ids(tok, segments(messages, tools, thinking, add_generation_prompt))


def continuation_ids(tok: Tokenizer, messages: Sequence[dict], thinking: bool = False) -> list[int]:
  """The ids that follow an assistant turn in a conversation: `messages` (e.g. the results of
  its tool calls) rendered as render_ids renders them there, then the generation prompt.
  Thinking on, the messages of the current round keep their reasoning."""
  for message in messages:
    _check(message)
  segs = [seg for m in messages for seg in _message_segments(m, thinking, True)] + _generation_prompt(thinking)
  return _ids(tok, segs)[0]


def parse_assistant(tok: Tokenizer, ids: Sequence[int], thinking: bool = False,
                    tools: Sequence[dict] | None = None) -> Turn:
  """The turn a model wrote after the generation prompt (anything after its first <|im_end|>
  is ignored). Never raises on model output."""
  ids = [int(i) for i in ids]
  names = {i: n for n, i in tok.special.items()}
  end_id = tok.special[IM_END]
  if end_id not in ids:
    return _truncated(tok, ids, thinking)
  body = ids[:ids.index(end_id)]
  tokens = tuple(ids[:len(body) + 1])
  reasoning = ""
  if thinking:
    close = tok.special[END_THINK]
    if close not in body:
      return Turn("", tok.decode(body), (), "unfinished_thinking", tokens)
    cut = body.index(close)
    if any(i in names for i in body[:cut]):
      return Turn("", tok.decode(body[:cut]), (), "stray_token", tokens)
    reasoning, body = tok.decode(body[:cut]), body[cut + 1:]
  begin = tok.special[SECTION_BEGIN]
  head = body[:body.index(begin)] if begin in body else body
  content = tok.decode(head)
  if any(i in names for i in head):
    return Turn(content, reasoning, (), "stray_token", tokens)
  if begin not in body:
    return Turn(content, reasoning, (), None if content.strip() else "empty", tokens)
  calls, error = _parse_section(tok, body[len(head) + 1:], names, tools)
  return Turn(content, reasoning, calls, error, tokens)


def _truncated(tok: Tokenizer, ids: list[int], thinking: bool) -> Turn:
  """A turn without <|im_end|>: its reasoning and content split at </think> where it has one."""
  close = tok.special[END_THINK]
  if not thinking:
    return Turn(tok.decode(ids), "", (), "truncated", tuple(ids))
  cut = ids.index(close) if close in ids else len(ids)
  return Turn(tok.decode(ids[cut + 1:]), tok.decode(ids[:cut]), (), "truncated", tuple(ids))


def _parse_section(tok, section: list[int], names: dict[int, str], tools) -> tuple[tuple[ToolCall, ...], str | None]:
  """The calls of `section` (the ids after <|tool_calls_section_begin|>), or the first fault."""
  special = tok.special
  if special[SECTION_END] not in section:
    return (), "unclosed_section"
  end = section.index(special[SECTION_END])
  if section[end + 1:]:
    return (), "text_after_calls"
  inner, calls = section[:end], []
  allowed = {special[CALL_BEGIN], special[ARGUMENT_BEGIN], special[CALL_END]}
  if any(i in names and i not in allowed for i in inner):
    return (), "stray_token"
  declared = {(t.get("function", t))["name"] for t in tools} if tools else None
  while inner:
    if inner[0] != special[CALL_BEGIN] or special[CALL_END] not in inner:
      return tuple(calls), "malformed_call"
    stop = inner.index(special[CALL_END])
    call, inner = inner[1:stop], inner[stop + 1:]
    if call.count(special[ARGUMENT_BEGIN]) != 1 or special[CALL_BEGIN] in call:
      return tuple(calls), "malformed_call"
    split = call.index(special[ARGUMENT_BEGIN])
    call_id, raw = tok.decode(call[:split]).strip(), tok.decode(call[split + 1:])
    match = CALL_ID.fullmatch(call_id)
    if not match:
      return tuple(calls), "bad_call_id"
    if declared is not None and match.group(1) not in declared:
      return tuple(calls), "unknown_tool"
    try:
      arguments = json.loads(raw)
    except ValueError:
      return tuple(calls), "bad_arguments"
    if not isinstance(arguments, dict):
      return tuple(calls), "arguments_not_object"
    calls.append(ToolCall(call_id, match.group(1), arguments))
  return (tuple(calls), None) if calls else ((), "empty_section")
