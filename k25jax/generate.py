"""Talk to a checkpoint on the k25jax sampler: a k25jax workdir (any stage's) or a Hugging Face folder.

    python -m k25jax.generate --checkpoint=RUN_OR_HF_DIR                      # a chat, the answers streamed
    python -m k25jax.generate --checkpoint=... --prompt="What is 12+30?"      # one turn, then exit
    python -m k25jax.generate --checkpoint=... --prompts=in.jsonl --out=out.jsonl   # batched, offline

`--image=PATH` puts an image before the (first) prompt's text (K2.5 models); `--system`,
`--temperature` (0: greedy), `--top_p`, `--max_new_tokens`, `--seed`, `--step` (a workdir's
checkpoint; default the newest). In the chat, an empty line or end of input ends it.

The prompt is written in the format the checkpoint's tokenizer speaks
(`k25jax.data.chat_formats`): the K2.5 chat format when the vocabulary has its tokens,
k25jax's legacy chat format for the runs that train in it (SFT, RL and PARL in the chat
rendering), plain text continued for a pre-training run. An answer streams a token at a
time (`sampler.stream`), each printed once its text is whole (a byte-level vocabulary
writes a character in several ids).

`--prompts`: one JSON record a line, `{"prompt": TEXT}` or `{"messages": [...]}` (OpenAI-shaped;
`"image": PATH` optional); every record comes back in `--out` with `"completion"` and
`"error"` (the format's turn error, e.g. "truncated", or null), all of them decoded in
batches of `--batch` rows by one sampler call each (`decode.decode`).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from typing import Iterator, Sequence, TextIO

import jax
from absl import app, flags

from k25jax.data import chat_formats, vision as vision_data
from k25jax.model.config import K25Config
from k25jax.rl import decode, media_rows, sampler
from k25jax.train import saved_model

STREAM_WIDTH_MULTIPLE = 64     # a streamed prompt is padded to this: a chat compiles once per 64 tokens, not per turn

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A k25jax workdir or a Hugging Face folder.")
_STEP = flags.DEFINE_integer("step", None, "A workdir's checkpoint (default: the newest).")
_PROMPT = flags.DEFINE_string("prompt", None, "One user turn: answer it, then exit.")
_PROMPTS = flags.DEFINE_string("prompts", None, "A JSONL file of {\"prompt\"} or {\"messages\"} records.")
_OUT = flags.DEFINE_string("out", None, "Where --prompts' records go, each with its \"completion\".")
_IMAGE = flags.DEFINE_string("image", None, "An image file shown with the (first) prompt (K2.5 models).")
_SYSTEM = flags.DEFINE_string("system", None, "A system prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1: off).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 256, "Tokens a turn may write.")
_SEED = flags.DEFINE_integer("seed", 0, "The sampler's seed.")
_BATCH = flags.DEFINE_integer("batch", 16, "Rows per sampler call for --prompts.")
_MAX_PATCHES = flags.DEFINE_integer("max_patches", vision_data.IMAGE_MAX_PATCHES,
                                    "An image larger than this many 14x14 patches is scaled down.")


class Talker:
  """A loaded checkpoint, its prompt format and the sampler's settings: `stream` answers one
  conversation a token at a time, `complete` many at once."""

  def __init__(self, saved: saved_model.SavedModel, sampling: sampler.SamplingConfig, seed: int = 0,
               max_patches: int = vision_data.IMAGE_MAX_PATCHES):
    if saved.tokenizer is None:
      raise ValueError("the checkpoint names no tokenizer (a run whose vocabulary is its stage's own: the compact "
                       "addition task or the PARL DSL), so there is no text to prompt it with")
    self.saved, self.max_patches = saved, max_patches
    self.format = chat_formats.for_tokenizer(saved.tokenizer)
    self.sampling = dataclasses.replace(sampling, stop_tokens=self.format.stop_ids)
    self.rng = jax.random.PRNGKey(seed)

  def image(self, path: str | None) -> vision_data.Media | None:
    if path is None:
      return None
    if not isinstance(self.saved.cfg, K25Config):
      raise ValueError(f"--image={path!r}: the checkpoint is a text model; images need a K2.5 model")
    return vision_data.preprocess_image(path, max_patches=self.max_patches)

  def _media_for(self, images: Sequence[vision_data.Media | None]) -> decode.MediaFor:
    """The rows' image features and placeholder mask for padded prompts (None without images)."""
    if not any(m is not None for m in images):
      return lambda prompts: None
    return media_rows.rows_media(self.saved.cfg, self.saved.params, images)

  def _key(self) -> jax.Array:
    self.rng, key = jax.random.split(self.rng)
    return key

  def stream(self, messages: Sequence[dict], image: vision_data.Media | None = None) -> Iterator[str]:
    """The answer's text as it is written, piece by piece; then `self.last` holds its Reply."""
    prompt = self.format.prompt(messages, image)
    padded, _ = decode.pad([prompt], self.saved.text_cfg, self.sampling, width_multiple=STREAM_WIDTH_MULTIPLE,
                           bucket_rows=False)
    media = self._media_for([image])(padded)
    ids, shown = [], 0
    for token, _ in sampler.stream(self.saved.text_cfg, self.saved.text_params, padded, len(prompt), self._key(),
                                   self.sampling, media=media):
      ids.append(token)
      text = self.format.reply(ids).text
      if not text.endswith("\ufffd") and len(text) > shown:
        yield text[shown:]
        shown = len(text)
    self.last = self.format.reply(ids)
    if len(self.last.text) > shown:
      yield self.last.text[shown:]

  def complete(self, conversations: Sequence[Sequence[dict]], images: Sequence[vision_data.Media | None] = (),
               batch: int = 16) -> list[chat_formats.Reply]:
    """Every conversation's answer, `batch` rows to a sampler call."""
    images = list(images) or [None] * len(conversations)
    replies = []
    for start in range(0, len(conversations), batch):
      chunk = slice(start, start + batch)
      prompts = [self.format.prompt(m, i) for m, i in zip(conversations[chunk], images[chunk])]
      out = decode.decode(self.saved.text_cfg, self.saved.text_params, prompts, self._key(), self.sampling,
                          media_for=self._media_for(images[chunk]))
      replies += [self.format.reply(tokens) for tokens, _ in decode.turns(out)]
    return replies


def conversation(record: dict, system: str | None = None) -> list[dict]:
  """A `--prompts` record's messages ({"prompt"} or {"messages"}), with `system` first if given."""
  if "messages" in record:
    messages = list(record["messages"])
  elif "prompt" in record:
    messages = [{"role": "user", "content": record["prompt"]}]
  else:
    raise ValueError(f"a --prompts record needs \"prompt\" or \"messages\"; got the keys {sorted(record)}")
  if system and not any(m["role"] == "system" for m in messages):
    messages.insert(0, {"role": "system", "content": system})
  return messages


def read_records(path: str) -> list[dict]:
  records = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if line.strip():
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{number}: not a JSON record ({e.msg})") from None
  return records


def chat_loop(talker: Talker, lines: Iterator[str], out: TextIO, system: str | None,
              media: vision_data.Media | None, once: bool) -> None:
  """Reads user turns from `lines`, writes each answer to `out` as it streams."""
  messages = [{"role": "system", "content": system}] if system else []
  for line in lines:
    if not line.strip():
      return
    messages.append({"role": "user", "content": line.rstrip("\n")})
    for piece in talker.stream(messages, media):
      out.write(piece)
      out.flush()
    out.write("\n" if talker.last.error is None else f"\n[{talker.last.error}]\n")
    if once:
      return
    messages.append({"role": "assistant", "content": talker.last.text})
    media = None           # the image went with the first turn; a later turn that needs it reads the history
    if talker.format.name == "text":
      messages = messages[:-2]    # a pre-training model continues each prompt on its own


def main(argv):
  del argv
  if not _CHECKPOINT.value:
    raise app.UsageError("--checkpoint is required (a k25jax workdir or a Hugging Face folder)")
  if bool(_PROMPTS.value) != bool(_OUT.value):
    raise app.UsageError("--prompts and --out go together")
  try:
    saved = saved_model.load(_CHECKPOINT.value, _STEP.value)
    sampling = sampler.SamplingConfig(max_new_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
                                      top_p=_TOP_P.value)
    talker = Talker(saved, sampling, _SEED.value, _MAX_PATCHES.value)
    if _PROMPTS.value:
      records = read_records(_PROMPTS.value)
      replies = talker.complete([conversation(r, _SYSTEM.value) for r in records],
                                [talker.image(r.get("image", _IMAGE.value)) for r in records], _BATCH.value)
      with open(_OUT.value, "w") as f:
        for record, reply in zip(records, replies):
          f.write(json.dumps({**record, "completion": reply.text, "error": reply.error}) + "\n")
      print(f"wrote {len(replies)} completions to {_OUT.value}")
      return
    print(f"{_CHECKPOINT.value}: {saved.source}, the {talker.format.name} format; an empty line ends the chat",
          file=sys.stderr)
    lines = iter([_PROMPT.value + "\n"]) if _PROMPT.value is not None else iter(sys.stdin.readline, "")
    chat_loop(talker, lines, sys.stdout, _SYSTEM.value, talker.image(_IMAGE.value), once=_PROMPT.value is not None)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main)
