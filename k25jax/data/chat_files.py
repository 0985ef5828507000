"""SFT chats from the user's files: `data.source=files` in configs/sft.py.

    data.files      = "GLOB,GLOB,..."   .jsonl, .jsonl.gz or .parquet, one record a conversation
    data.eval_files = "GLOB,..."        the held-out chats; empty: every `data.eval_every`-th
                                        record of data.files is held out

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                                {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.look:0",
                   "type": "function", "function": {"name": "look", "arguments": "{\\"x\\": 3}"}}]},
                  {"role": "tool", "tool_call_id": "functions.look:0", "content": "a cat"},
                  {"role": "assistant", "content": "A cat."}],
     "tools": [{"type": "function", "function": {"name": "look", "parameters": {...}}}]}

Messages are OpenAI-shaped (`k25jax.data.chat`: roles system, user, assistant, tool; content
text or parts; an assistant's `tool_calls` with arguments a JSON object or its text, and
`reasoning_content`; a tool result's `tool_call_id`); `tools` are JSON schemas (in Parquet, a
column of their JSON text). An image part
`{"type": "image", "image": PATH}` (a path relative to the record's file) is preprocessed for
MoonViT-3D, scaled to at most the patches of a `data.image_size` square, and rendered as its
media block. Each record is rendered by the K2.5 chat renderer (`chat.render_ids`, thinking
`data.thinking`) with the run's tokenizer; the loss mask is 1 on exactly what the model
writes (the assistant's content, reasoning when thinking, calls and `<|im_end|>`).

A bad record ends in `files.BadData`, one line naming its file and line (or Parquet row):
not an object; no `messages` list; a message that is not an object, has an unknown role, or
content that is neither text nor a list of text and image parts; an image in an assistant's
turn, an image path that is not text, does not exist or does not decode; a tool call without
a function name, arguments that are not a JSON object, a call to a tool the record does not
declare; a tool result without `tool_call_id`; tools that cannot be declared; no assistant
turn (an empty loss mask: nothing to learn); a rendering longer than `data.max_length`.
With `data.on_bad_record=skip` such records are skipped, counted and reported once the files
are read; an unreadable file, a glob that matches nothing, or no record left still stop.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from k25jax.data import chat, files, tool_declaration, vision
from k25jax.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Chat:
  """One rendered conversation: ids and loss mask (float32 [n]), its images in order."""

  where: str
  ids: np.ndarray
  loss_mask: np.ndarray
  images: tuple[vision.Media, ...]


@dataclasses.dataclass(frozen=True)
class Rendering:
  """How records become ids: the tokenizer (with the K2.5 chat tokens), thinking on or off,
  the longest rendering allowed and the image patch budget."""

  tokenizer: Tokenizer
  thinking: bool
  max_length: int
  max_patches: int


class _Bad(Exception):
  """What is wrong with a record (the message, without the record's place)."""


def _image(part: dict, folder: str, max_patches: int) -> vision.Media:
  path = part.get("image")
  if not isinstance(path, str) or not path:
    raise _Bad(f"an image part needs 'image': a path (text), got {path!r}")
  full = os.path.join(folder, os.path.expanduser(path))
  if not os.path.isfile(full):
    raise _Bad(f"image {path!r} does not exist ({full})")
  try:
    return vision.preprocess_image(full, max_patches=max_patches)
  except ValueError as e:
    raise _Bad(f"image {path!r} does not open ({e})") from None


def _content(content, role: str, index: int, folder: str, max_patches: int, images: list) -> str | list:
  """The content with each image part replaced by its placeholder count (what chat.render_ids
  takes), the images appended to `images` in order."""
  if content is None or isinstance(content, str):
    return content or ""
  if not isinstance(content, list):
    raise _Bad(f"messages[{index}].content must be text or a list of parts, got {type(content).__name__}")
  out = []
  for part in content:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
      out.append({"type": "text", "text": part["text"]})
    elif kind == "image":
      if role == "assistant":
        raise _Bad(f"messages[{index}]: an assistant turn holds no image (the model writes text)")
      media = _image(part, folder, max_patches)
      images.append(media)
      out.append({"type": "image", "tokens": media.num_tokens})
    else:
      raise _Bad(f"messages[{index}].content: a part must be {{'type': 'text', 'text': ...}} or "
                 f"{{'type': 'image', 'image': PATH}}, got {str(part)[:80]}")
  return out


def _tool_calls(calls, index: int, declared: set[str] | None) -> list[dict]:
  """The calls with their arguments parsed (a JSON object each)."""
  if not isinstance(calls, list) or not calls:
    raise _Bad(f"messages[{index}].tool_calls must be a non-empty list")
  out = []
  for j, call in enumerate(calls):
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
      raise _Bad(f"messages[{index}].tool_calls[{j}] needs 'function': {{'name', 'arguments'}}")
    if declared is not None and name not in declared:
      raise _Bad(f"messages[{index}] calls {name!r}, which the record's tools do not declare")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
      try:
        arguments = json.loads(arguments)
      except json.JSONDecodeError as e:
        raise _Bad(f"messages[{index}].tool_calls[{j}]: arguments are not JSON ({e.msg})") from None
    if not isinstance(arguments, dict):
      raise _Bad(f"messages[{index}].tool_calls[{j}]: arguments must be a JSON object")
    call_id = call.get("id")
    out.append({"id": call_id if isinstance(call_id, str) and call_id else f"functions.{name}:{j}",
                "type": "function", "function": {"name": name, "arguments": arguments}})
  return out


def _tools(record: dict) -> tuple[list[dict] | None, set[str] | None]:
  tools = record.get("tools")
  if tools is None:
    return None, None
  if isinstance(tools, str):   # a Parquet column of JSON text
    try:
      tools = json.loads(tools)
    except json.JSONDecodeError as e:
      raise _Bad(f"'tools' is text but not JSON ({e.msg})") from None
  if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
    raise _Bad("'tools' must be a list of JSON-schema objects")
  try:
    tool_declaration.declare(tools)
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise _Bad(f"'tools' cannot be declared ({type(e).__name__}: {e})") from None
  return tools, {(t.get("function", t)).get("name") for t in tools}


def messages_of(record, folder: str, max_patches: int) -> tuple[list[dict], list[dict] | None, list[vision.Media]]:
  """(messages as chat.render_ids takes them, tools, images in order) of one record, or _Bad."""
  if not isinstance(record, dict):
    raise _Bad("not a JSON object")
  messages = record.get("messages")
  if not isinstance(messages, list) or not messages:
    raise _Bad("needs 'messages': a non-empty list")
  tools, declared = _tools(record)
  out, images = [], []
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise _Bad(f"messages[{i}] is not an object")
    role = m.get("role")
    if role not in chat.ROLES:
      raise _Bad(f"messages[{i}] has role {role!r}; choose one of {chat.ROLES}")
    message = {"role": role, "content": _content(m.get("content"), role, i, folder, max_patches, images)}
    for field in ("name", "reasoning_content"):
      if isinstance(m.get(field), str) and m[field]:
        message[field] = m[field]
    if m.get("tool_calls"):
      if role != "assistant":
        raise _Bad(f"messages[{i}]: only assistant turns make tool calls, not {role!r}")
      message["tool_calls"] = _tool_calls(m["tool_calls"], i, declared)
    if role == "tool":
      if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
        raise _Bad(f"messages[{i}]: a tool result needs 'tool_call_id' (the call it answers)")
      message["tool_call_id"] = m["tool_call_id"]
    out.append(message)
  if not any(m["role"] == "assistant" for m in out):
    raise _Bad("no assistant turn: nothing to learn (an empty loss mask)")
  return out, tools, images


def render(record, folder: str, how: Rendering) -> tuple[list[int], list[float], list[vision.Media]]:
  """(ids, loss mask, images) of one record, or _Bad (module docstring)."""
  messages, tools, images = messages_of(record, folder, how.max_patches)
  ids, mask = chat.render_ids(how.tokenizer, messages, tools, thinking=how.thinking)
  if not any(mask):
    raise _Bad("nothing to learn: the loss mask is empty")
  if len(ids) > how.max_length:
    raise _Bad(f"renders to {len(ids)} tokens, more than data.max_length={how.max_length}")
  return ids, mask, images


def read(spec: str, field: str, how: Rendering, bad: files.BadRecords) -> list[Chat]:
  """The chats of every file the comma-separated globs of `spec` match, in order."""
  out = []
  for pattern, _ in files.parse(spec, field, weights=False):
    for path in files.matching(pattern, field):
      folder = os.path.dirname(os.path.abspath(path))
      for where, record in files.records(path, bad):
        try:
          ids, mask, images = render(record, folder, how)
        except _Bad as e:
          bad.found(f"{where}: {e}")
          continue
        out.append(Chat(where, np.asarray(ids, np.int32), np.asarray(mask, np.float32), tuple(images)))
  if not out:
    raise files.BadData(f"{field}={spec!r}: no usable chat record")
  return out


def load(data, how: Rendering) -> tuple[list[Chat], list[Chat]]:
  """(training chats, held-out chats) of a data section: `data.eval_files`, else every
  `data.eval_every`-th record of data.files held out."""
  if not data.files:
    raise files.BadData("data.source='files' needs data.files (GLOB,...: .jsonl, .jsonl.gz or .parquet chats)")
  bad = files.BadRecords(data.on_bad_record)
  chats = read(data.files, "data.files", how, bad)
  if data.eval_files:
    held_out = read(data.eval_files, "data.eval_files", how, bad)
  else:
    held_out = chats[data.eval_every - 1::data.eval_every]
    chats = [c for i, c in enumerate(chats) if (i + 1) % data.eval_every]
    if not chats or not held_out:
      raise files.BadData(f"data.files: {len(chats) + len(held_out)} chats; data.eval_every={data.eval_every} "
                          "must hold out some and leave some to train on (or give data.eval_files)")
  bad.report("data.files")
  return chats, held_out
