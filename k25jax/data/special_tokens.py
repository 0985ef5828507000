"""The names of the special tokens k25jax's tokenizers share, and decoding around them."""
from __future__ import annotations

from typing import NamedTuple, Sequence


class MediaIds(NamedTuple):
  """Ids of <|media_begin|>, <|media_content|>, <|media_end|> and <|media_pad|> (the placeholder)."""

  begin: int
  content: int
  end: int
  pad: int


MEDIA_TOKENS = MediaIds("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
CHAT_TOKENS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
               "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>")
BOS_TOKEN, EOS_TOKEN = "[BOS]", "[EOS]"


def decode_with_specials(ids: Sequence[int], names: dict[int, str], decode_run) -> str:
  """`decode_run` over the runs of ids between special ones, which are written by name."""
  out, run = [], []
  for i in (int(i) for i in ids):
    if i in names:
      out += [decode_run(run), names[i]]
      run = []
    else:
      run.append(i)
  return "".join(out + [decode_run(run)])
