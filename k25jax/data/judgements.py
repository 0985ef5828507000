"""The judge's chats: what a generative reward model (`k25jax.rl.grm`) reads and writes, and the
SFT data that teaches a model to write it (configs/grm.py).

    user       (the image)  "Task: {question}\\nResponse: {response}\\n[Reference: {reference}\\n]"
               + INSTRUCTION
    assistant  "{critique}.\\nScore: k/10"

in Kimi K2.5's chat format after an empty system turn. The SFT chats are descriptions of
synthetic scenes (`descriptions`) with 0..MAX_ERRORS errors each or guessed (`P_GUESS`), some
without their count prefix (`P_NO_COUNT`), judged by `descriptions.critique`: the errors,
then the hidden rubric as a score out of 10. Half of them are guesses of the objects at their
true quadrants: a judge trained on near misses alone learns to check the layout and the count
and passes guessed colours and shapes (a policy found that within 5 RL iterations, docs/grm.md).
"""
from __future__ import annotations

import numpy as np

from k25jax.data import chat, descriptions, vision

INSTRUCTION = "List its errors, then Score: k/10."
MAX_ERRORS = 4
P_NO_COUNT = 0.05
P_GUESS = 0.5


def messages(question: str, response: str, image_tokens: int | None = None, reference: str | None = None
             ) -> list[dict]:
  """The judge's prompt as chat messages: an empty system turn, then the user's turn with the
  image block first (`image_tokens` placeholders) when there is one."""
  text = f"Task: {question}\nResponse: {response}\n" + (f"Reference: {reference}\n" if reference else "") + INSTRUCTION
  content = text if image_tokens is None else [{"type": "image", "tokens": image_tokens},
                                               {"type": "text", "text": text}]
  return [chat.EMPTY_SYSTEM, {"role": "user", "content": content}]


def description_to_judge(rng: np.random.Generator, task: descriptions.DescribeTask) -> str:
  """A description of the task's scene: with probability P_GUESS a guess of the objects at
  their true quadrants (`descriptions.guess`, each attribute redrawn with a probability drawn
  from U(0.3, 1): a weak describer's errors), else the scene's description with 0..MAX_ERRORS
  errors (uniform); without its count prefix with probability P_NO_COUNT."""
  if rng.random() < P_GUESS:
    text = descriptions.guess(rng, task.objects, rng.uniform(0.3, 1.0))
  else:
    text = descriptions.corrupt(rng, task.objects, int(rng.integers(0, MAX_ERRORS + 1)))
  return text.split(": ", 1)[1] if rng.random() < P_NO_COUNT else text


def chats(n: int, seed: int, tok, max_patches: int = vision.IMAGE_MAX_PATCHES
          ) -> list[tuple[list[int], list[float], vision.Media]]:
  """n judge SFT chats over fresh scenes: (ids, loss mask on the judgement, the image)."""
  rng = np.random.default_rng([seed, 7177])
  out = []
  for task in descriptions.make_tasks(n, seed):
    media = vision.preprocess_image(task.image, max_patches=max_patches)
    response = description_to_judge(rng, task)
    conversation = messages(task.question, response, media.num_tokens) + [
        {"role": "assistant", "content": descriptions.critique(response, task.objects)}]
    ids, mask = chat.render_ids(tok, conversation)
    out.append((ids, mask, media))
  return out
