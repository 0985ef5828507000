"""Zero-vision SFT data: text-only trajectories that answer questions about images with a Python tool.

The model never sees the image: the question names it (`img_2`), the assistant writes
code that works on the array of that name with `k25jax.agents.image_ops` (binarize,
colour masks, connected components, boxes, region comparison), the tool's output comes
from ACTUALLY running that code in a sandbox session holding the task's image, and the
final turn states the answer (in k25jax's legacy chat format; `k25jax.data.tool_formats`
writes the same trajectory in Kimi K2.5's, the code as a call of the declared `python` tool):

    <|user|> How many red objects are in img_2? <|end|>
    <|assistant|> <|call|> print(count_objects(img_2, "red")) <|end|>
    <|tool|> 3 <|end|>
    <|assistant|> 3 <|end|>

Tasks and their reference programs come from `k25jax.data.image_tasks` (counting,
locating, comparing, reading); a trajectory uses the one-call program, or with
probability `p_two_calls` the two-call one whose second call reads the state the first
left in the session. The loss mask is 1 only on what the model writes (`fmt.trajectory`).
The answer is the task's ground truth, computed from the drawing, and generation fails
loudly if the tool's final output disagrees with it.
"""
from __future__ import annotations

import asyncio
from typing import Sequence

import numpy as np

from k25jax.data import image_tasks, legacy_chat, packing

Steps = list[tuple[str, str]]   # a trajectory's (code, tool output) per call


def shards(tasks: Sequence[image_tasks.ImageTask]) -> list[list[int]]:
  """Task indices grouped so that no two tasks of a group share an image name (greedy, in order)."""
  groups: list[list[int]] = []
  names: list[set[str]] = []
  for i, task in enumerate(tasks):
    g = next((g for g, taken in enumerate(names) if task.image_name not in taken), None)
    if g is None:
      groups.append([])
      names.append(set())
      g = len(groups) - 1
    groups[g].append(i)
    names[g].add(task.image_name)
  return groups


async def _run_shard(pool, tasks, shard: list[int], programs, output_chars: int) -> dict[int, list[str]]:
  """Runs the programs of a shard's tasks, in order, in ONE session holding all their images."""
  outputs = {}
  async with pool.session(images={tasks[i].image_name: tasks[i].image for i in shard}) as session:
    for i in shard:
      task, outputs[i] = tasks[i], []
      for code in programs[i]:
        result = await session.arun(code)
        if not result.ok:
          raise RuntimeError(f"reference program of a {task.kind} task failed in the sandbox: {result.error}\n{code}")
        outputs[i].append(legacy_chat.tool_output(result, output_chars))
      if not image_tasks.grade(outputs[i][-1], task.answer):
        raise RuntimeError(f"the tool printed {outputs[i][-1]!r} for a {task.kind} task whose answer is "
                           f"{task.answer!r}")
  return outputs


async def _run_all(pool, tasks, programs, output_chars: int) -> list[list[str]]:
  done = await asyncio.gather(*(_run_shard(pool, tasks, shard, programs, output_chars) for shard in shards(tasks)))
  merged = {i: out for part in done for i, out in part.items()}
  return [merged[i] for i in range(len(tasks))]


def conversations(tasks: Sequence[image_tasks.ImageTask], pool, *, p_two_calls: float, seed: int,
                  output_chars: int = 120) -> list[Steps]:
  """One trajectory per task: the (code, output) of each call, the outputs from sandbox
  sessions of `pool` (the answer is the task's). Deterministic given seed.

  A worker process costs ~0.1 s of CPU to start, so tasks whose images have different
  names share a session (`shards`): each program runs verbatim on its own image, and every
  task's first call assigns the variables its later calls read.
  """
  if not 0.0 <= p_two_calls <= 1.0:
    raise ValueError(f"p_two_calls={p_two_calls} must be a probability")
  two = np.random.default_rng([seed, 2]).random(len(tasks)) < p_two_calls
  programs = [task.programs[-1] if pick else task.programs[0] for task, pick in zip(tasks, two)]
  outputs = asyncio.run(_run_all(pool, tasks, programs, output_chars))
  return [list(zip(p, o, strict=True)) for p, o in zip(programs, outputs)]


def encode(rendered: Sequence[tuple[list[int], list[float]]], max_length: int, pad_id: int) -> dict[str, np.ndarray]:
  """Rendered trajectories (ids, loss mask), right-padded (`packing.right_padded`): tokens int32
  [n, max_length], loss_mask float32 [n, max_length], length int32 [n]."""
  longest = max(len(t) for t, _ in rendered)
  if longest > max_length:
    raise ValueError(f"a conversation has {longest} tokens, more than data.max_length={max_length}")
  return packing.right_padded(rendered, max_length, pad_id)


def dataset(n: int, seed: int, pool, fmt, *, image_size: int, kinds: Sequence[str], p_two_calls: float,
            max_length: int) -> dict[str, np.ndarray]:
  """n zero-vision SFT trajectories over fresh tasks (`image_tasks.make_tasks(n, seed, ...)`),
  rendered in the tool format `fmt` (`k25jax.data.tool_formats`)."""
  tasks = image_tasks.make_tasks(n, seed, image_size, tuple(kinds))
  steps = conversations(tasks, pool, p_two_calls=p_two_calls, seed=seed)
  return encode([fmt.trajectory(t.question, s, t.answer) for t, s in zip(tasks, steps)], max_length, fmt.pad_id)
