"""RL prompts from the user's files: `task.name=file` in configs/rl.py.

    task.files      = "GLOB,GLOB,..."   .jsonl, .jsonl.gz or .parquet, one record a prompt
    task.eval_files = "GLOB,..."        the held-out prompts; empty: `task.eval_prompts` records
                                        drawn from task.files (seed `task.seed`) are held out
    task.verifier   = "exact"           the verifier of records that name none

    {"prompt": "What is 7 * 6?", "answer": "42", "verifier": "math"}
    {"messages": [{"role": "user", "content": "..."}], "tests": ["assert f(2) == 4"],
     "verifier": "python_tests", "completion": "def f(x):\\n  return x * x"}

A record has `prompt` (text) or `messages` (user and assistant turns, the last one the user's;
a system turn first in the K2.5 format), the fields its verifier reads (`k25jax.rl.verifiers`:
`answer`, `tests`, `tolerance`) and anything else a user's verifier wants. The prompt is
rendered in the run's chat format, `task.rendering` (k25jax's legacy `chat` or Kimi's `k2.5`:
the messages, then the assistant's turn opened); the completion is graded by the record's
verifier on the text before the stop token (a completion without one, or a tool call, is
unparsable and scores 0). `correct` (accuracy, Toggle's gate) is a reward of 1 or more.

The built-in warm start (no init.checkpoint) fine-tunes on the records' demonstrations: a
record's `completion`, else its `answer` for the exact, numeric and math verifiers.

The rl_vision stage (configs/rl.py:vision, `task.files`) reads the same files for records of
a `prompt` and an optional `image` (a path relative to the record's file; the model sees it in
its prompt, scaled to at most the patches of a `task.image_size` square, and the Python tool
holds it as `img_1`), each episode's final answer scored by the record's verifier
(`VisionPromptTask`, logged under the ability `from_files`).

A file that cannot be read, a glob that matches nothing, a bad record (not an object, no or
both of prompt and messages, a malformed message, an image in the text stage, messages or a
missing image in rl_vision, a field its verifier needs), an unknown verifier, a prompt too
long for the model and a verifier that raises or returns no finite number end in `BadData`, one
line naming the file and line (`python -m k25jax.main` exits 2); with `task.on_bad_record=skip`
bad records are skipped and counted (one warning once the files are read), and a verifier
that raises scores 0 with a warning naming the record. An image that does not decode is
BadData naming its record when it is first drawn.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os

import numpy as np
from absl import logging

from k25jax.data import files, vision
from k25jax.rl import tasks, verifiers

ROLES = {"chat": ("user", "assistant"), "k2.5": ("system", "user", "assistant")}   # a prompt's roles, by rendering
DEMONSTRATED = ("exact", "numeric", "math")   # verifiers whose answer is itself a correct completion
KEPT_SCORES = 8192                            # scores a Scorer keeps (then it starts afresh)


@dataclasses.dataclass(frozen=True)
class PromptRecord:
  where: str                 # "path:line" (JSONL) or "path:row N" (Parquet)
  messages: tuple[dict, ...]
  verifier: str
  record: dict
  image: str | None = None   # the image file (rl_vision), its path resolved beside the record's file

  @property
  def prompt(self) -> str:
    """The prompt's text: the last user message's."""
    return self.messages[-1]["content"]

  @property
  def demonstration(self) -> str | None:
    if isinstance(self.record.get("completion"), str):
      return self.record["completion"]
    return str(self.record["answer"]) if self.verifier in DEMONSTRATED else None


def _messages(record: dict, images: bool, roles: tuple[str, ...]) -> tuple[dict, ...] | str:
  """The prompt as messages of `roles`, or what is wrong with it (`images`: the rl_vision
  stage's records, a `prompt` and an optional image)."""
  if ("prompt" in record) == ("messages" in record):
    return "give exactly one of 'prompt' (text) and 'messages'"
  if "image" in record and not images:
    return ("an image prompt: the text RL stage takes text; image prompts are the rl_vision stage's "
            "(configs/rl.py:vision)")
  if "messages" in record and images:
    return "the rl_vision stage takes a 'prompt' (text) and an optional 'image', not 'messages'"
  if "prompt" in record:
    prompt = record["prompt"]
    return ({"role": "user", "content": prompt},) if isinstance(prompt, str) and prompt.strip() else \
        "'prompt' must be non-empty text"
  messages = record["messages"]
  if not isinstance(messages, list) or not messages:
    return "'messages' must be a non-empty list"
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in roles or not isinstance(m.get("content"), str):
      return (f"messages[{i}] must be {{'role': one of {roles}, 'content': text}} in the run's chat format, "
              f"got {str(m)[:80]}")
  if messages[-1]["role"] != "user":
    return "the last message must be the user's (the completion answers it)"
  return tuple(messages)


def _verifier(name, known: dict) -> str | None:
  """None when `name` is a usable verifier (imported once, cached in `known`), else why not."""
  if not isinstance(name, str):
    return f"'verifier' must be text, got {name!r}"
  if name not in known:
    try:
      known[name] = verifiers.get(name)
    except ValueError as e:
      known[name] = str(e)
  return None if callable(known[name]) else known[name]


def _image(path: str, record: dict) -> tuple[str | None, str | None]:
  """(the record's image file beside `path` or None without one, what is wrong with it or None)."""
  if "image" not in record:
    return None, None
  if not isinstance(record["image"], str):
    return None, f"'image' must be a path (text), got {record['image']!r}"
  image = os.path.join(os.path.dirname(os.path.abspath(path)), os.path.expanduser(record["image"]))
  return (image, None) if os.path.isfile(image) else (None, f"image {record['image']!r} does not exist ({image})")


def read(spec: str, field: str, default_verifier: str, bad: files.BadRecords, known: dict,
         images: bool = False, roles: tuple[str, ...] = ROLES["chat"]) -> list[PromptRecord]:
  """The prompt records of every file the comma-separated globs of `spec` match (`images`:
  the rl_vision stage's, module docstring)."""
  out = []
  for pattern, _ in files.parse(spec, field, weights=False):
    for path in files.matching(pattern, field):
      for where, record in files.records(path, bad):
        if not isinstance(record, dict):
          bad.found(f"{where}: not a JSON object")
          continue
        messages = _messages(record, images, roles)
        name = record.get("verifier", default_verifier)
        problem = (messages if isinstance(messages, str) else _verifier(name, known)
                   or verifiers.check_record(name, record))
        image, problem = (None, problem) if problem else _image(path, record)
        if problem:
          bad.found(f"{where}: {problem}")
          continue
        out.append(PromptRecord(where, messages, name, record, image))
  if not out:
    raise files.BadData(f"{field}={spec!r}: no usable prompt record")
  return out


class Scorer:
  """Each record's verifier, imported once (`known`), and what a failing verifier does
  (`bad`'s policy): `score(record, completion)`; scores are kept, so grading an answer twice
  (the reward, then the accuracy) runs its verifier once."""

  def __init__(self, bad: files.BadRecords, known: dict):
    self.bad, self.known, self._scores = bad, known, {}

  def score(self, record: PromptRecord, completion: str) -> float:
    """The record's verifier on `completion`; a verifier that raises or returns no finite
    number is BadData naming the record (scored 0 with a warning under on_bad_record=skip)."""
    key = (record.where, completion)
    if key not in self._scores:
      if len(self._scores) >= KEPT_SCORES:
        self._scores.clear()
      self._scores[key] = self._score(record, completion)
    return self._scores[key]

  def _score(self, record: PromptRecord, completion: str) -> float:
    try:
      reward = float(self.known[record.verifier](record.prompt, completion, record.record))
      if not math.isfinite(reward):
        raise ValueError(f"returned {reward}")
    except Exception as e:  # pylint: disable=broad-except  (a user's function: any failure is reported)
      message = f"{record.where}: verifier {record.verifier!r} failed ({type(e).__name__}: {e})"
      if not self.bad.skip:
        raise files.BadData(message) from e
      logging.warning("%s; scored 0 (task.on_bad_record=skip)", message)
      return 0.0
    return reward


def check(config) -> None:
  """The fields of a task section with `task.files` that can be checked before reading them:
  its default verifier imports, `on_bad_record` is one of files.ON_BAD_RECORD (ValueError naming it)."""
  verifiers.get(config.verifier)
  if config.on_bad_record not in files.ON_BAD_RECORD:
    raise ValueError(f"task.on_bad_record={config.on_bad_record!r}: must be one of {files.ON_BAD_RECORD}")


def files_digest(config) -> str:
  """A hash of the contents of every file `task.files` and `task.eval_files` match, in order:
  what a warm start trained on them depends on beyond the config."""
  digest = hashlib.sha1()
  for spec, field in ((config.files, "task.files"), (config.eval_files, "task.eval_files")):
    for pattern, _ in files.parse(spec, field, weights=False) if spec else ():
      for path in files.matching(pattern, field):
        with open(path, "rb") as f:
          digest.update(path.encode() + b"\0")
          for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
  return digest.hexdigest()


def split_records(config, images: bool = False, roles: tuple[str, ...] = ROLES["chat"]
                  ) -> tuple[list[PromptRecord], list[PromptRecord], Scorer]:
  """(training records, held-out records, their scorer) of a task section (module docstring)."""
  if not config.files:
    raise ValueError("prompts from files need task.files (GLOB,...: .jsonl, .jsonl.gz or .parquet records)")
  bad, known = files.BadRecords(config.on_bad_record), {}
  records = read(config.files, "task.files", config.verifier, bad, known, images, roles)
  if config.eval_files:
    held_out = read(config.eval_files, "task.eval_files", config.verifier, bad, known, images, roles)
  else:
    if not 0 < config.eval_prompts < len(records):
      raise files.BadData(f"task.files: {len(records)} records; task.eval_prompts={config.eval_prompts} of them "
                          "are held out, which must leave some to train on (or give task.eval_files)")
    order = np.random.default_rng(config.seed).permutation(len(records))
    held_out = [records[i] for i in sorted(order[:config.eval_prompts])]
    records = [records[i] for i in sorted(order[config.eval_prompts:])]
  bad.report("task.files")
  return records, held_out, Scorer(bad, known)


class FileTask:
  """The RL stage's task (the interface of `k25jax.stages.rl.AdditionTask`) from prompt files,
  rendered in `task.rendering`: k25jax's legacy chat format ("chat") or Kimi K2.5's ("k2.5",
  where a prompt may open with a system message, else gets the rendering's empty one)."""

  def __init__(self, config, max_positions: int):
    if config.rendering not in ROLES:
      raise ValueError(f"task.name='file' renders prompts as chat turns: task.rendering={config.rendering!r} must be "
                       f"one of {tuple(ROLES)} ('compact' is the addition task's 17-token vocabulary)")
    self.render = tasks.rendering(config.rendering)
    self.tokenizer = self.render.tokenizer
    self.stop_tokens = (self.render.stop_id,)
    records, held_out, self.scorer = split_records(config, roles=ROLES[config.rendering])
    self.train, self.eval = self._split(records), self._split(held_out)
    longest = max((self.train, self.eval), key=lambda split: split["prompt_length"].max())
    row = int(longest["prompt_length"].argmax())
    self.max_new_tokens = max_positions - int(longest["prompt_length"][row])   # rl.max_new_tokens is clipped to it
    if self.max_new_tokens < 1:
      raise files.BadData(f"{longest['record'][row].where}: the prompt is {longest['prompt_length'][row]} tokens, "
                          f"leaving no room for an answer in model.max_position_embeddings={max_positions}")

  def _split(self, records: list[PromptRecord]) -> dict[str, np.ndarray]:
    prompts = [self.render.conversation(r.messages) for r in records]
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.full((len(prompts), int(lengths.max())), self.render.pad_id, np.int32)
    for row, p in enumerate(prompts):
      tokens[row, :len(p)] = p
    held = np.empty(len(records), object)
    held[:] = records
    return {"tokens": tokens, "prompt_length": lengths, "record": held}

  def demonstrations(self, n: int, seed: int, p_scratch: float, p_check: float):
    """n rows of a prompt and its record's demonstration (module docstring), drawn with
    replacement; (tokens, completion mask, lengths) as `tasks.addition_demonstrations`."""
    del p_scratch, p_check      # the addition task's
    shown = [(row, r.demonstration) for row, r in enumerate(self.train["record"]) if r.demonstration is not None]
    if not shown:
      raise ValueError("task.name='file': no training record has a demonstration ('completion', or 'answer' with the "
                       f"{'/'.join(DEMONSTRATED)} verifiers) for the built-in warm start: set init.checkpoint")
    picks = np.random.default_rng(seed).integers(0, len(shown), n)
    rows = []
    for i in picks:
      row, text = shown[i]
      rows.append((self.train["tokens"][row, :self.train["prompt_length"][row]].tolist(), self.render.completion(text)))
    width = max(len(p) + len(c) for p, c in rows)
    tokens = np.full((n, width), self.render.pad_id, np.int32)
    mask = np.zeros((n, width), np.float32)
    for j, (p, c) in enumerate(rows):
      tokens[j, :len(p) + len(c)] = p + c
      mask[j, len(p):len(p) + len(c)] = 1.0
    return tokens, mask, np.array([len(p) + len(c) for p, c in rows], np.int32)

  def grade(self, split: dict, rows: np.ndarray, completions: np.ndarray) -> dict:
    """reward, correct (reward >= 1), unparsable, length (through the first stop) and
    num_unparsable of each completion row (the prompt of split row `rows[j]`)."""
    completions = np.asarray(completions)
    texts = [self.render.completion_text(row) for row in completions]
    reward = np.array([0.0 if text is None else self.scorer.score(record, text)
                       for record, text in zip(split["record"][rows], texts)], np.float32)
    unparsable = np.array([text is None for text in texts], bool)
    return {"reward": reward, "correct": reward >= 1.0, "unparsable": unparsable,
            "length": tasks.completion_lengths(completions, self.render.stop_id),
            "num_unparsable": int(unparsable.sum())}


# ------------------------------------------------------------------ the rl_vision stage's tasks
IMAGE_NAME = "img_1"     # a record's image in the Python tool's namespace


@functools.lru_cache(maxsize=256)
def _pixels(path: str) -> np.ndarray:
  return vision.load_image(path)


@dataclasses.dataclass(frozen=True)
class VisionPromptTask:
  """A record as a task of the rl_vision stage (the interface of `image_tasks.ImageTask`): its
  prompt the question, its image (if any) in the prompt and as `img_1` in the Python tool's
  namespace; `reward` is the verifier's score of the final answer, `grade` a reward of 1 or more."""

  record: PromptRecord
  scorer: Scorer
  kind: str = "file"

  @property
  def question(self) -> str:
    return self.record.prompt

  @property
  def image(self) -> np.ndarray | None:
    """The image's RGB pixels; an image that does not decode is BadData naming the record."""
    if self.record.image is None:
      return None
    try:
      return _pixels(self.record.image)
    except ValueError as e:
      raise files.BadData(f"{self.record.where}: {e}") from None

  @property
  def images(self) -> dict[str, np.ndarray]:
    return {} if self.record.image is None else {IMAGE_NAME: self.image}

  def reward(self, answer: str | None) -> float:
    return 0.0 if answer is None else self.scorer.score(self.record, answer)

  def grade(self, answer: str | None) -> bool:
    return self.reward(answer) >= 1.0


def vision_tasks(config) -> tuple[list[VisionPromptTask], list[VisionPromptTask]]:
  """(training tasks, held-out tasks) of the rl_vision stage's task section from its files."""
  train, held_out, scorer = split_records(config, images=True)
  return [VisionPromptTask(r, scorer) for r in train], [VisionPromptTask(r, scorer) for r in held_out]
