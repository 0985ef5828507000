"""Verifiable tasks for the RL stage: a prompt source and a reward function each, all offline.

Two families:

* `addition`: the synthetic 2-digit addition task of the RL/Toggle probe (tiny runs),
  structured data (the operands a, b) with a text form, and two renderings of that text.
  The text: the question `a1a0+b1b0=` (operands most-significant digit first) and a
  completion `[a0a1+b0b1>]s0s1s2[?a0a1+b0b1>s0s1s2]`. The answer s0s1s2 is the sum
  written least-significant digit first, zero-padded to 3 digits (57 → 750). The
  optional scratch block before it restates the operands LSD first (useful: it lines the
  digits up in the order the answer is produced); the optional check block after it
  restates the whole equation (useless: the answer is already out). Correct answers so
  come in four lengths, and a length budget has something to trim: 3, 9, 13 or 19
  characters, one token each in every rendering, plus the stop token.

      rendering  prompt                                              completion ends with
      chat       BOS <|user|> 57+68= <|end|> <|assistant|>           <|end|>     (`ChatRendering`)
      k2.5       the K2.5 chat format, an empty system turn (35 ids) <|im_end|>  (`K25Rendering`)
      compact    ^57+68=   over a 17-token vocabulary                $           (`CompactRendering`)

  `chat` is k25jax's own chat format through `k25jax.data.legacy_chat.ChatTokenizer` (bytes, media,
  role and tool tokens: the vocabulary of the tiny chat model), configs/rl.py's default;
  `k2.5` is Kimi K2.5's chat format over the byte tokenizer with its chat tokens
  (`configs/rl.py:tiny,k25_format`); `compact` keeps a 17-token model for the fastest CPU
  runs, and is what the functions below render when no `render` is given. All grade the
  decoded text with one parser.

* `ReasoningGymTask`: `countdown` and `gsm_symbolic` from the `reasoning-gym` package,
  generated procedurally (no download) for `small` runs; text prompts, text completions
  with the answer inside <answer>...</answer>.

Rewards are 1 for a correct answer and 0 otherwise. An answer that cannot be parsed
scores 0 and is flagged, and graders return the count, so the RL stage can log it.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from k25jax.data import chat as k25_chat, legacy_chat as chat, tokenizer as tokenizer_lib

# --- 2-digit addition: the text ----------------------------------------------------------

SCRATCH_LENGTH = 6        # a0a1+b0b1>
ANSWER_LENGTH = 3         # s0s1s2
CHECK_LENGTH = 10         # ?a0a1+b0b1>s0s1s2
MAX_COMPLETION_LENGTH = SCRATCH_LENGTH + ANSWER_LENGTH + CHECK_LENGTH + 1   # with the stop token
_OPERANDS = re.compile(r"[0-9]{2}\+[0-9]{2}>")
_ANSWER = re.compile(r"[0-9]{3}")
_CHECK = re.compile(r"\?[0-9]{2}\+[0-9]{2}>[0-9]{3}")


def _check_operands(a: int, b: int) -> None:
  if not (0 <= a <= 99 and 0 <= b <= 99):
    raise ValueError(f"operands must be 2-digit numbers in [0, 99], got {a} and {b}")


def _reversed(value: int, width: int) -> str:
  """value's digits, least significant first, zero-padded to `width`."""
  return f"{value:0{width}d}"[::-1]


def addition_question(a: int, b: int) -> str:
  """`a1a0+b1b0=`, the operands most-significant digit first (57, 8 → "57+08=")."""
  _check_operands(a, b)
  return f"{a:02d}+{b:02d}="


def addition_answer_text(a: int, b: int, *, scratch: bool, check: bool) -> str:
  """A correct completion's text, with or without the scratch and the check blocks."""
  _check_operands(a, b)
  restated = f"{_reversed(a, 2)}+{_reversed(b, 2)}>"
  answer = _reversed(a + b, ANSWER_LENGTH)
  return (restated if scratch else "") + answer + (f"?{restated}{answer}" if check else "")


def parse_addition_text(text: str | None) -> int | None:
  """The answer in a completion's text (before its stop token), or None if malformed.

  Grammar: [scratch] answer [check], with scratch `dd+dd>`, answer three digits (least
  significant first) and check `?dd+dd>ddd`. The contents of scratch and check are not
  graded, only their form; None (a truncated generation) is malformed.
  """
  if text is None:
    return None
  if len(text) >= SCRATCH_LENGTH + ANSWER_LENGTH and _OPERANDS.fullmatch(text[:SCRATCH_LENGTH]):
    text = text[SCRATCH_LENGTH:]
  answer, rest = text[:ANSWER_LENGTH], text[ANSWER_LENGTH:]
  if not _ANSWER.fullmatch(answer) or (rest and not _CHECK.fullmatch(rest)):
    return None
  return int(answer[::-1])


# --- 2-digit addition: the renderings ------------------------------------------------------

ADDITION_VOCAB = ("_", "^", "$", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "=", ">", "?")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


class AdditionTokenizer:
  """Characters ↔ ids over `ADDITION_VOCAB`: `_` pad, `^` BOS, `$` EOS, digits, `+ = > ?`."""

  vocab = ADDITION_VOCAB
  vocab_size = len(ADDITION_VOCAB)
  pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

  def __init__(self):
    self._ids = {ch: i for i, ch in enumerate(self.vocab)}

  def encode(self, text: str) -> list[int]:
    try:
      return [self._ids[ch] for ch in text]
    except KeyError as e:
      raise ValueError(f"{e.args[0]!r} is not in the addition vocabulary {''.join(self.vocab)!r}") from None

  def decode(self, ids) -> str:
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"token ids {bad} are outside the addition vocabulary (size {self.vocab_size})")
    return "".join(self.vocab[i] for i in ids)


def _before_stop(ids: Sequence[int], stop_id: int) -> list[int] | None:
  """The ids before the first `stop_id`, or None when there is none (a truncated generation)."""
  ids = [int(i) for i in ids]
  return ids[:ids.index(stop_id)] if stop_id in ids else None


class CompactRendering:
  """`^question` → `completion$` over the 17-token `AdditionTokenizer` (one token per character)."""

  def __init__(self):
    self.tokenizer = AdditionTokenizer()
    self.stop_id, self.pad_id = EOS_ID, PAD_ID

  def prompt(self, question: str) -> list[int]:
    return [BOS_ID] + self.tokenizer.encode(question)

  def completion(self, text: str) -> list[int]:
    return self.tokenizer.encode(text) + [self.stop_id]

  def completion_text(self, ids: Sequence[int]) -> str | None:
    """The text a generated completion answers with (None without the stop token)."""
    body = _before_stop(ids, self.stop_id)
    return None if body is None else self.tokenizer.decode(body)


class ChatRendering:
  """k25jax's own chat format (`k25jax.data.legacy_chat`): the question is the user message, the
  completion the assistant's answer turn.

      prompt      BOS <|user|> question <|end|> <|assistant|>
      completion  text <|end|>

  A generated turn that is a tool call (`<|call|>` first) or holds another role token is
  not an answer: its text is None, and it scores as unparsable.
  """

  def __init__(self, tokenizer: chat.ChatTokenizer | None = None):
    self.tokenizer = tokenizer if tokenizer is not None else chat.ChatTokenizer()
    self.stop_id, self.pad_id = self.tokenizer.end_id, self.tokenizer.pad_id

  def prompt(self, question: str) -> list[int]:
    return self.conversation([{"role": "user", "content": question}])

  def conversation(self, messages: Sequence[dict]) -> list[int]:
    """User and assistant messages ({"role", "content"}), then the assistant's turn opened."""
    tokens, _ = chat.render(self.tokenizer, [chat.Message(m["role"], m["content"]) for m in messages])
    return tokens + [self.tokenizer.assistant_id]

  def completion(self, text: str) -> list[int]:
    return self.tokenizer.encode(text) + [self.stop_id]

  def completion_text(self, ids: Sequence[int]) -> str | None:
    turn = chat.parse_turn(self.tokenizer, ids)
    return None if turn.call or turn.error in ("truncated", "stray_token") else turn.text


class K25Rendering:
  """The K2.5 chat format (`k25jax.data.chat`) over the byte tokenizer with its chat tokens
  (275 ids): the question is the user message after an empty system turn (in place of the
  template's default one, whose 52 bytes the tiny model's 64 positions would not hold), the
  completion the assistant's answer with thinking off.

      prompt      <|im_system|>system<|im_middle|><|im_end|><|im_user|>user<|im_middle|>57+68=<|im_end|>
                  <|im_assistant|>assistant<|im_middle|><think></think>          (35 ids)
      completion  text <|im_end|>

  A generated turn with a tool call, a stray special token or no <|im_end|> is not an answer:
  its text is None, and it scores as unparsable.
  """

  SYSTEM = {"role": "system", "content": ""}

  def __init__(self):
    self.tokenizer = tokenizer_lib.ByteTokenizer(media=True, chat=True)
    self.stop_id, self.pad_id = self.tokenizer.special[k25_chat.IM_END], tokenizer_lib.PAD_ID

  def prompt(self, question: str) -> list[int]:
    return self.conversation([{"role": "user", "content": question}])

  def conversation(self, messages: Sequence[dict]) -> list[int]:
    """Messages in the OpenAI shape (the empty system turn first unless they start with one),
    then the generation prompt."""
    head = [] if messages and messages[0]["role"] == "system" else [self.SYSTEM]
    return k25_chat.render_ids(self.tokenizer, head + list(messages), add_generation_prompt=True)[0]

  def completion(self, text: str) -> list[int]:
    return self.tokenizer.encode(text) + [self.stop_id]

  def completion_text(self, ids: Sequence[int]) -> str | None:
    turn = k25_chat.parse_assistant(self.tokenizer, ids)
    return None if turn.error or turn.tool_calls else turn.content


RENDERINGS = {"chat": ChatRendering, "k2.5": K25Rendering, "compact": CompactRendering}
COMPACT = CompactRendering()


def rendering(name: str):
  """The addition task's rendering called `name` ("chat" | "k2.5" | "compact")."""
  if name not in RENDERINGS:
    raise ValueError(f"task.rendering={name!r}; choose from {sorted(RENDERINGS)}")
  return RENDERINGS[name]()


# --- 2-digit addition: prompts, demonstrations, grades -----------------------------------------

def addition_prompt(a: int, b: int, render=COMPACT) -> list[int]:
  """The prompt's token ids (compact: `^ a1 a0 + b1 b0 =`, 7 ids)."""
  return render.prompt(addition_question(a, b))


def addition_completion(a: int, b: int, *, scratch: bool, check: bool, render=COMPACT) -> list[int]:
  """A correct completion's token ids, the stop token included."""
  return render.completion(addition_answer_text(a, b, scratch=scratch, check=check))


def _padded(rows: list[list[int]], width: int, pad_id: int) -> np.ndarray:
  out = np.full((len(rows), width), pad_id, np.int32)
  for j, row in enumerate(rows):
    out[j, :len(row)] = row
  return out


def _operands(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """n operand pairs drawn uniformly from [0, 99]², deterministic given seed: a, b int32 [n]."""
  rng = np.random.default_rng(seed)
  return rng.integers(0, 100, size=n).astype(np.int32), rng.integers(0, 100, size=n).astype(np.int32)


def addition_prompts(n: int, seed: int, render=COMPACT) -> dict[str, np.ndarray]:
  """n prompts with the operands `_operands(n, seed)` (the same in every rendering).

  Returns tokens int32 [n, longest prompt] (right-padded), prompt_length int32 [n], a, b int32 [n].
  """
  a, b = _operands(n, seed)
  prompts = [addition_prompt(int(x), int(y), render) for x, y in zip(a, b)]
  lengths = np.array([len(p) for p in prompts], np.int32)
  return {"tokens": _padded(prompts, int(lengths.max(initial=0)), render.pad_id), "prompt_length": lengths,
          "a": a, "b": b}


def addition_demonstrations(n: int, seed: int, *, p_scratch: float = 0.5, p_check: float = 0.5,
                            render=COMPACT) -> dict[str, np.ndarray]:
  """n SFT demonstrations, prompt + correct completion, each block present with its probability.

  Returns (deterministic given seed; the prompts of `addition_prompts(n, seed)`):
    tokens           int32 [n, longest prompt + MAX_COMPLETION_LENGTH]  prompt, completion, then PAD
    completion_mask  float32 [n, ...]  1 on completion tokens (the stop included): the SFT
                     targets, i.e. weights = completion_mask[:, 1:] for targets tokens[:, 1:]
    length           int32 [n]  prompt + completion tokens
    completion_length int32 [n]
    a, b             int32 [n]  the operands;  scratch, check  bool [n]  the blocks used
  """
  if not (0.0 <= p_scratch <= 1.0 and 0.0 <= p_check <= 1.0):
    raise ValueError(f"p_scratch={p_scratch} and p_check={p_check} must be probabilities")
  prompts = addition_prompts(n, seed, render)
  rng = np.random.default_rng([seed, 1])
  scratch = rng.random(n) < p_scratch
  check = rng.random(n) < p_check
  rows = [prompts["tokens"][j, :prompts["prompt_length"][j]].tolist()
          + addition_completion(int(prompts["a"][j]), int(prompts["b"][j]), scratch=bool(scratch[j]),
                                check=bool(check[j]), render=render) for j in range(n)]
  width = prompts["tokens"].shape[1] + MAX_COMPLETION_LENGTH
  length = np.array([len(row) for row in rows], np.int32)
  position = np.arange(width)[None, :]
  completion_mask = ((position >= prompts["prompt_length"][:, None]) & (position < length[:, None])).astype(np.float32)
  return {"tokens": _padded(rows, width, render.pad_id), "completion_mask": completion_mask,
          "length": length, "completion_length": length - prompts["prompt_length"],
          "a": prompts["a"], "b": prompts["b"], "scratch": scratch, "check": check}


def parse_addition(completion, render=COMPACT) -> int | None:
  """The answer in a generated completion (token ids after the prompt; anything after the
  first stop token is ignored), or None if the completion is malformed or has no stop
  (`parse_addition_text`'s grammar)."""
  return parse_addition_text(render.completion_text(completion))


def completion_lengths(completions: np.ndarray, stop_id: int) -> np.ndarray:
  """int32 [n]: each row's tokens up to and including its first `stop_id` (the row's width if none)."""
  is_stop = completions == stop_id
  return np.where(is_stop.any(axis=1), is_stop.argmax(axis=1) + 1, completions.shape[1]).astype(np.int32)


def grade_addition(completions, a, b, render=COMPACT) -> dict:
  """Rewards for a batch of generated completions: 1 if the parsed answer is a + b, else 0.

  completions: int [n, T] generated tokens (PAD or anything after the first stop token);
  a, b: int [n] the operands of each row's prompt. Returns
    reward      float32 [n]  1.0 correct, 0.0 wrong or unparsable
    correct     bool [n]
    unparsable  bool [n]     the completion did not follow the grammar (scored 0)
    length      int32 [n]    completion tokens up to and including the first stop (T if none)
    num_unparsable  int      unparsable.sum(), for the logs
  """
  completions = np.asarray(completions)
  a, b = np.asarray(a), np.asarray(b)
  if completions.ndim != 2 or not a.shape == b.shape == completions.shape[:1]:
    raise ValueError(f"completions {completions.shape} must be [n, T] with a {a.shape}, b {b.shape} [n]")
  answers = [parse_addition(row, render) for row in completions]
  unparsable = np.array([ans is None for ans in answers], bool)
  correct = np.array([ans is not None and ans == x + y for ans, x, y in zip(answers, a, b)], bool)
  return {"reward": correct.astype(np.float32), "correct": correct, "unparsable": unparsable,
          "length": completion_lengths(completions, render.stop_id), "num_unparsable": int(unparsable.sum())}


# --- 2-digit addition as a chat task (joint RL) ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """One addition question as a chat task beside the image tasks (`k25jax.data.image_tasks`):
  the user message is `addition_question(a, b)`, an answer turn is graded by
  `parse_addition_text` (any of the four correct forms scores). No image."""

  a: int
  b: int
  kind: str = "addition"

  @property
  def question(self) -> str:
    return addition_question(self.a, self.b)

  @property
  def answer(self) -> str:
    """The shortest correct answer (the bare sum, least-significant digit first)."""
    return addition_answer_text(self.a, self.b, scratch=False, check=False)

  @property
  def images(self) -> dict[str, np.ndarray]:
    return {}

  def grade(self, answer: str | None) -> bool:
    return parse_addition_text(answer) == self.a + self.b

  def reward(self, answer: str | None) -> float:
    """The RL reward: 1 for a correct answer, else 0."""
    return float(self.grade(answer))


def arithmetic_tasks(n: int, seed: int, exclude: frozenset = frozenset()) -> list[ArithmeticTask]:
  """n addition tasks, the operands `_operands(n, seed)` when `exclude` is empty; otherwise
  the first n of `_operands(4n, seed)` whose (a, b) are not in `exclude` (a held-out split)."""
  a, b = _operands(4 * n if exclude else n, seed)
  pairs = [(int(x), int(y)) for x, y in zip(a, b) if (int(x), int(y)) not in exclude]
  if len(pairs) < n:
    raise ValueError(f"{n} addition tasks outside the {len(exclude)} excluded: draw fewer")
  return [ArithmeticTask(a, b) for a, b in pairs[:n]]


# The abilities joint RL groups its tasks by (what a task asks for, not its modality): a task
# kind (`ArithmeticTask.kind`, `k25jax.data.image_tasks.KINDS`) → its ability.
ABILITIES = {"addition": "arithmetic", "count": "visual_counting", "read": "visual_reading",
             "locate": "visual_spatial", "compare": "visual_spatial", "describe": "visual_description",
             "file": "from_files"}


# --- reasoning-gym tasks ---------------------------------------------------------------

REASONING_GYM_TASKS = ("countdown", "gsm_symbolic")
ANSWER_FORMAT = "Give the final answer inside <answer></answer> tags."


def _reasoning_gym():
  try:
    import reasoning_gym  # pylint: disable=import-outside-toplevel
    from reasoning_gym import utils  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("ReasoningGymTask needs the `reasoning-gym` package: pip install reasoning-gym "
                      "(it generates countdown / gsm_symbolic tasks offline)") from e
  return reasoning_gym, utils


class ReasoningGymTask:
  """`countdown` or `gsm_symbolic` from reasoning-gym: `size` tasks generated offline from `seed`.

      task = ReasoningGymTask("countdown", size=1000, seed=0)
      task.prompt(i)                    question + ANSWER_FORMAT
      task.demonstration(i)             a correct completion (gsm: worked solution + tagged answer)
      task.grade(indices, completions)  {"reward", "correct", "unparsable", "num_unparsable"}

  The reward is 1 when reasoning-gym's own verifier gives full marks to the text inside
  the last <answer>...</answer> tag, 0 otherwise (its partial credit for a well-formed
  wrong answer is dropped); no tag at all is unparsable. `config` goes to the
  reasoning-gym dataset config (e.g. min_numbers=3 for countdown).
  """

  def __init__(self, name: str, size: int, seed: int, **config):
    if name not in REASONING_GYM_TASKS:
      raise ValueError(f"reasoning-gym task {name!r}; available: {REASONING_GYM_TASKS}")
    reasoning_gym, self._utils = _reasoning_gym()
    self.name = name
    self.dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    self.entries = [self.dataset[i] for i in range(size)]

  def __len__(self) -> int:
    return len(self.entries)

  def prompt(self, i: int) -> str:
    return f"{self.entries[i]['question']}\n{ANSWER_FORMAT}"

  def demonstration(self, i: int) -> str:
    entry = self.entries[i]
    if self.name == "gsm_symbolic":
      reasoning = entry["metadata"]["answer_cot"].split("####")[0].strip()
      return f"{reasoning}\n<answer>{entry['answer']}</answer>"
    return f"<answer>{entry['answer']}</answer>"

  def grade(self, indices, completions) -> dict:
    """indices: [n] task index of each completion; completions: n strings."""
    indices = [int(i) for i in indices]
    if len(indices) != len(completions):
      raise ValueError(f"{len(indices)} indices for {len(completions)} completions")
    answers = [self._utils.extract_answer(text) for text in completions]
    unparsable = np.array([ans is None for ans in answers], bool)
    correct = np.array([ans is not None and self.dataset.score_answer(ans, self.entries[i]) >= 1.0
                        for ans, i in zip(answers, indices)], bool)
    return {"reward": correct.astype(np.float32), "correct": correct, "unparsable": unparsable,
            "num_unparsable": int(unparsable.sum())}
