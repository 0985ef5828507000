"""Verifiable tasks for the RL stage: a prompt source and a reward function each, all offline.

Two families:

* `addition`: the synthetic 2-digit addition task of the RL/Toggle probe (tiny runs).
  A 17-token vocabulary; correct answers come in four lengths, so a length budget
  has something to trim:

      prompt      ^ a1 a0 + b1 b0 =                     7 tokens, operands MSD first
      completion  [a0 a1 + b0 b1 >] s0 s1 s2 [? a0 a1 + b0 b1 > s0 s1 s2] $

  `^` is BOS, `$` EOS. The answer s0 s1 s2 is the sum written least-significant digit
  first, zero-padded to 3 digits (57 → 7 5 0). The optional scratch block before it
  restates the operands LSD first (useful: it lines the digits up in the order the
  answer is produced); the optional check block after it restates the whole equation
  (useless: the answer is already out). Completion lengths, EOS included: 4 (bare),
  10 (scratch), 14 (check), 20 (both); prompt + completion ≤ 27 tokens.

* `ReasoningGymTask`: `countdown` and `gsm_symbolic` from the `reasoning-gym` package,
  generated procedurally (no download) for `small` runs; text prompts, text completions
  with the answer inside <answer>...</answer>.

Rewards are 1 for a correct answer and 0 otherwise. An answer that cannot be parsed
scores 0 and is flagged, and graders return the count, so the RL stage can log it.
"""
from __future__ import annotations

import numpy as np

# --- 2-digit addition ------------------------------------------------------------------

ADDITION_VOCAB = ("_", "^", "$", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "=", ">", "?")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
PLUS_ID, EQUALS_ID, THEN_ID, CHECK_ID = 13, 14, 15, 16
DIGIT_IDS = tuple(range(3, 13))
PROMPT_LENGTH = 7
SCRATCH_LENGTH = 6        # a0 a1 + b0 b1 >
ANSWER_LENGTH = 3         # s0 s1 s2
CHECK_LENGTH = 10         # ? a0 a1 + b0 b1 > s0 s1 s2
MAX_COMPLETION_LENGTH = SCRATCH_LENGTH + ANSWER_LENGTH + CHECK_LENGTH + 1
MAX_LENGTH = PROMPT_LENGTH + MAX_COMPLETION_LENGTH


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


def _digit(d: int) -> int:
  return DIGIT_IDS[d]


def _reversed_digits(value: int, width: int) -> list[int]:
  """value's digits, least significant first, zero-padded to `width`, as token ids."""
  return [_digit((value // 10 ** k) % 10) for k in range(width)]


def addition_prompt(a: int, b: int) -> list[int]:
  """`^ a1 a0 + b1 b0 =` (operands most-significant digit first), 7 token ids."""
  if not (0 <= a <= 99 and 0 <= b <= 99):
    raise ValueError(f"operands must be 2-digit numbers in [0, 99], got {a} and {b}")
  return [BOS_ID, *_reversed_digits(a, 2)[::-1], PLUS_ID, *_reversed_digits(b, 2)[::-1], EQUALS_ID]


def addition_completion(a: int, b: int, *, scratch: bool, check: bool) -> list[int]:
  """A correct completion (EOS included) with or without the scratch and the check blocks."""
  restated = [*_reversed_digits(a, 2), PLUS_ID, *_reversed_digits(b, 2), THEN_ID]
  answer = _reversed_digits(a + b, ANSWER_LENGTH)
  tokens = (restated if scratch else []) + answer
  if check:
    tokens += [CHECK_ID, *restated, *answer]
  return tokens + [EOS_ID]


def addition_prompts(n: int, seed: int) -> dict[str, np.ndarray]:
  """n prompts with operands drawn uniformly from [0, 99], deterministic given seed.

  Returns tokens int32 [n, 7], a int32 [n], b int32 [n].
  """
  rng = np.random.default_rng(seed)
  a = rng.integers(0, 100, size=n).astype(np.int32)
  b = rng.integers(0, 100, size=n).astype(np.int32)
  tokens = np.array([addition_prompt(int(x), int(y)) for x, y in zip(a, b)], np.int32).reshape(n, PROMPT_LENGTH)
  return {"tokens": tokens, "a": a, "b": b}


def addition_demonstrations(n: int, seed: int, *, p_scratch: float = 0.5,
                            p_check: float = 0.5) -> dict[str, np.ndarray]:
  """n SFT demonstrations, prompt + correct completion, each block present with its probability.

  Returns (deterministic given seed):
    tokens           int32 [n, MAX_LENGTH]  prompt, completion, then PAD
    completion_mask  float32 [n, MAX_LENGTH]  1 on completion tokens (EOS included): the
                     SFT targets, i.e. weights = completion_mask[:, 1:] for targets tokens[:, 1:]
    length           int32 [n]  prompt + completion tokens
    completion_length int32 [n]
    a, b             int32 [n]  the operands;  scratch, check  bool [n]  the blocks used
  """
  if not (0.0 <= p_scratch <= 1.0 and 0.0 <= p_check <= 1.0):
    raise ValueError(f"p_scratch={p_scratch} and p_check={p_check} must be probabilities")
  prompts = addition_prompts(n, seed)
  rng = np.random.default_rng([seed, 1])
  scratch = rng.random(n) < p_scratch
  check = rng.random(n) < p_check
  tokens = np.full((n, MAX_LENGTH), PAD_ID, np.int32)
  completion_mask = np.zeros((n, MAX_LENGTH), np.float32)
  completion_length = np.zeros(n, np.int32)
  for j in range(n):
    a, b = int(prompts["a"][j]), int(prompts["b"][j])
    completion = addition_completion(a, b, scratch=bool(scratch[j]), check=bool(check[j]))
    end = PROMPT_LENGTH + len(completion)
    tokens[j, :end] = prompts["tokens"][j].tolist() + completion
    completion_mask[j, PROMPT_LENGTH:end] = 1.0
    completion_length[j] = len(completion)
  return {"tokens": tokens, "completion_mask": completion_mask,
          "length": completion_length + PROMPT_LENGTH, "completion_length": completion_length,
          "a": prompts["a"], "b": prompts["b"], "scratch": scratch, "check": check}


def _is_operand_block(tokens) -> bool:
  """`d d + d d >`: the restated operands (their values are not graded)."""
  return (len(tokens) == SCRATCH_LENGTH and all(t in DIGIT_IDS for t in tokens[0:2])
          and tokens[2] == PLUS_ID and all(t in DIGIT_IDS for t in tokens[3:5]) and tokens[5] == THEN_ID)


def parse_addition(completion) -> int | None:
  """The answer in a generated completion, or None if the completion is malformed.

  completion: token ids generated after the prompt (anything after the first EOS is
  ignored). Grammar: [scratch] answer [check] EOS, with scratch `d d + d d >`, answer
  three digits (least significant first) and check `? d d + d d > d d d`. The contents
  of scratch and check are not graded, only their form; a missing EOS (a truncated
  generation) is malformed.
  """
  tokens = [int(t) for t in completion]
  if EOS_ID not in tokens:
    return None
  tokens = tokens[:tokens.index(EOS_ID)]
  if len(tokens) >= SCRATCH_LENGTH + ANSWER_LENGTH and _is_operand_block(tokens[:SCRATCH_LENGTH]):
    tokens = tokens[SCRATCH_LENGTH:]
  answer, rest = tokens[:ANSWER_LENGTH], tokens[ANSWER_LENGTH:]
  if len(answer) != ANSWER_LENGTH or any(t not in DIGIT_IDS for t in answer):
    return None
  if rest and not (len(rest) == CHECK_LENGTH and rest[0] == CHECK_ID
                   and _is_operand_block(rest[1:1 + SCRATCH_LENGTH])
                   and all(t in DIGIT_IDS for t in rest[1 + SCRATCH_LENGTH:])):
    return None
  return sum((t - DIGIT_IDS[0]) * 10 ** k for k, t in enumerate(answer))


def grade_addition(completions, a, b) -> dict:
  """Rewards for a batch of generated completions: 1 if the parsed answer is a + b, else 0.

  completions: int [n, T] generated tokens (PAD or anything after the first EOS);
  a, b: int [n] the operands of each row's prompt. Returns
    reward      float32 [n]  1.0 correct, 0.0 wrong or unparsable
    correct     bool [n]
    unparsable  bool [n]     the completion did not follow the grammar (scored 0)
    length      int32 [n]    completion tokens up to and including the first EOS (T if none)
    num_unparsable  int      unparsable.sum(), for the logs
  """
  completions = np.asarray(completions)
  a, b = np.asarray(a), np.asarray(b)
  if completions.ndim != 2 or not a.shape == b.shape == completions.shape[:1]:
    raise ValueError(f"completions {completions.shape} must be [n, T] with a {a.shape}, b {b.shape} [n]")
  answers = [parse_addition(row) for row in completions]
  unparsable = np.array([ans is None for ans in answers], bool)
  correct = np.array([ans is not None and ans == x + y for ans, x, y in zip(answers, a, b)], bool)
  is_eos = completions == EOS_ID
  length = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, completions.shape[1]).astype(np.int32)
  return {"reward": correct.astype(np.float32), "correct": correct, "unparsable": unparsable,
          "length": length, "num_unparsable": int(unparsable.sum())}


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
