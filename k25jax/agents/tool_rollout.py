"""Multi-turn rollouts of a chat model with the sandboxed Python tool (`k25jax.agents.sandbox`).

An episode starts from its task's prompt in the run's tool format (`k25jax.data.tool_formats`:
k25jax's legacy chat format, or Kimi K2.5's with `python` a declared tool), its image before
the question for a vision model, and runs in rounds; in each round every unfinished episode
gets one assistant turn, all of them decoded in ONE batched call, and then all their tool
calls run at once in their own sandbox sessions (one persistent session per episode, opened
at its first call):

    turn = decode(context)                                  (tokens under the loss)
    call(s) → context += turn + their results + the next turn's opening
              (each result: stdout, or "Error: ..."; a turn's calls run in order)
    answer  → the episode ends; its answer is the turn's text
    ends also at `max_turns` turns, when the next turn would not fit in `max_context`
    tokens, or on a turn without its stop token (truncated)

A malformed call (empty code, a stray special token, arguments that are not JSON, ...) or a
call when the tool is off gets an error observation, never a crash. Metrics (`summarize`):
answer accuracy, tool-call success rate (calls whose code ran without error / calls made),
calls and turns per episode, and how episodes finished.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from k25jax.agents import sandbox
from k25jax.data import image_tasks, legacy_chat, tool_formats
from k25jax.data import vision as vision_data
from k25jax.model import k25
from k25jax.model.config import K25Config, ModelConfig
from k25jax.rl import decode, media_rows, sampler

FINISHES = ("answer", "truncated", "turn_limit", "length_limit")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  max_turns: int = 4             # assistant turns per episode, the answer included
  max_context: int = 512         # tokens per episode (prompt, turns, tool outputs)
  turn_tokens: int = 160         # tokens generated per assistant turn at most
  tool: bool = True              # False: a call gets "Error: no tool" (no-tool baselines)
  output_chars: int = 120        # tool output kept per call (longer output is cut, marked "...")

  def __post_init__(self):
    for name in ("max_turns", "max_context", "turn_tokens", "output_chars"):
      if getattr(self, name) <= 0:
        raise ValueError(f"RolloutConfig.{name} must be positive, got {getattr(self, name)}")


@dataclasses.dataclass
class ToolEpisode:
  """One episode: its tokens, the loss mask (1 on generated tokens) and their sampling
  log-probs, the answer, and the tool calls it made."""

  tokens: list[int]
  loss_mask: list[float]
  logprobs: list[float]
  prompt_length: int
  turns: int = 0
  calls: int = 0
  call_errors: int = 0
  answer: str | None = None
  finish: str = ""

  @property
  def done(self) -> bool:
    return bool(self.finish)


# Decoder: (contexts, episode indices) → one (generated tokens, log-probs) per context.
Decoder = Callable[[Sequence[Sequence[int]], Sequence[int]], list[tuple[list[int], list[float]]]]


def banned_tokens(tok) -> tuple[int, ...]:
  """Tokens the model may never write: the media tokens (a placeholder it wrote would take an
  image's features). Sampling drops them, and so must the loss's log π (`rollout.mask_banned`)."""
  return tuple(tok.media or ())


def _append(t: ToolEpisode, tokens: Sequence[int], mask: float, logprobs: Sequence[float] | None = None) -> None:
  t.tokens += list(tokens)
  t.loss_mask += [mask] * len(tokens)
  t.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)


async def _play(decode: Decoder, fmt, tasks: Sequence[image_tasks.ImageTask], prompts: Sequence[Sequence[int]],
                pool, config: RolloutConfig) -> list[ToolEpisode]:
  transcripts = [ToolEpisode(list(p), [0.0] * len(p), [0.0] * len(p), len(p)) for p in prompts]
  sessions: dict[int, object] = {}
  async with contextlib.AsyncExitStack() as stack:
    while True:
      for t in transcripts:
        if not t.done and len(t.tokens) + config.turn_tokens > config.max_context:
          t.finish = "length_limit"
      active = [i for i, t in enumerate(transcripts) if not t.done]
      if not active:
        break
      generated = decode([transcripts[i].tokens for i in active], active)
      turns: dict[int, tool_formats.ToolTurn] = {}
      for i, (tokens, logprobs) in zip(active, generated):
        t = transcripts[i]
        turn = fmt.parse(tokens)
        _append(t, turn.tokens, 1.0, logprobs[:len(turn.tokens)])
        t.turns += 1
        if turn.error == "truncated":
          t.finish = "truncated"
        elif not turn.is_call:
          t.answer, t.finish = turn.answer, "answer"
        else:
          turns[i] = turn
      outputs: dict[int, list[str]] = {}
      runs = []
      for i, turn in turns.items():
        t = transcripts[i]
        if turn.malformed_call or not config.tool:
          t.calls += max(1, len(turn.calls))
          t.call_errors += max(1, len(turn.calls))
          outputs[i] = ([f"Error: malformed call ({turn.error})"] if turn.malformed_call else
                        ["Error: no tool is available in this task"] * len(turn.calls))
          continue
        if i not in sessions:
          sessions[i] = await stack.enter_async_context(pool.session(images=tasks[i].images))
        runs.append(i)
      results = await asyncio.gather(*(_run_calls(sessions[i], turns[i].calls) for i in runs))
      for i, done in zip(runs, results):
        outputs[i] = [legacy_chat.tool_output(result, config.output_chars) for result in done]
        transcripts[i].calls += len(done)
        transcripts[i].call_errors += sum(not result.ok for result in done)
      for i, texts in outputs.items():
        t = transcripts[i]
        _append(t, fmt.results(turns[i], texts), 0.0)
        if t.turns >= config.max_turns:
          t.finish = "turn_limit"
  return transcripts


async def _run_calls(session, codes: Sequence[str]) -> list:
  """A turn's calls, in order, in the episode's session."""
  return [await session.arun(code) for code in codes]


def play(decode: Decoder, fmt, tasks: Sequence[image_tasks.ImageTask], pool, config: RolloutConfig,
         media: Sequence[vision_data.Media | None] | None = None) -> list[ToolEpisode]:
  """Plays one episode per task to the end in the tool format `fmt` (`tool_formats`), in waves
  of `pool.max_sessions` episodes (each episode may hold a session until it ends). `media[i]`
  (optional) is task i's image, placed before its question (a vision model). The decoder gets
  the episodes' indices into `tasks`."""
  media = media if media is not None else [None] * len(tasks)
  prompts = [fmt.prompt(task.question, m) for task, m in zip(tasks, media)]
  transcripts = []
  for start in range(0, len(tasks), pool.max_sessions):
    wave = range(start, min(start + pool.max_sessions, len(tasks)))
    offset_decode = lambda contexts, episodes, s=start: decode(contexts, [s + e for e in episodes])
    transcripts += asyncio.run(_play(offset_decode, fmt, [tasks[i] for i in wave], [prompts[i] for i in wave],
                                     pool, config))
  return transcripts


def summarize(transcripts: Sequence[ToolEpisode], tasks: Sequence[image_tasks.ImageTask]) -> dict[str, float]:
  """accuracy (each task's `grade` of its episode's answer), per task kind too, tool_call_success (calls that ran without error / calls; nan if none),
  calls and turns per episode, length (generated tokens), and the share of each finish."""
  correct = [task.grade(t.answer) for t, task in zip(transcripts, tasks)]
  calls = sum(t.calls for t in transcripts)
  out = {"accuracy": float(np.mean(correct)),
         "tool_call_success": (calls - sum(t.call_errors for t in transcripts)) / calls if calls else float("nan"),
         "calls_per_episode": calls / len(transcripts),
         "turns_per_episode": float(np.mean([t.turns for t in transcripts])),
         "generated_tokens": float(np.mean([sum(t.loss_mask) for t in transcripts]))}
  for finish in FINISHES:
    out[f"finish/{finish}"] = float(np.mean([t.finish == finish for t in transcripts]))
  for kind in dict.fromkeys(task.kind for task in tasks):
    out[f"{kind}/accuracy"] = float(np.mean([c for c, task in zip(correct, tasks) if task.kind == kind]))
  return out


# ------------------------------------------------------------------------------ decoders
TURN_WIDTH_MULTIPLE = 64   # contexts are padded to a multiple of this many tokens (few sampler shapes)


def text_decoder(cfg: ModelConfig, params, sampling: sampler.SamplingConfig, seed: int = 0,
                 min_rows: int = 1) -> Decoder:
  """A Decoder over the text model: one sampler call per round (`decode.decode`; min_rows =
  the wave size keeps one row count per run)."""
  rng = [jax.random.PRNGKey(seed)]

  def decode_turns(contexts, episodes):
    del episodes
    rng[0], key = jax.random.split(rng[0])
    return decode.turns(decode.decode(cfg, params, contexts, key, sampling, width_multiple=TURN_WIDTH_MULTIPLE,
                                      min_rows=min_rows))
  return decode_turns


def vision_decoder(cfg: K25Config, params, sampling: sampler.SamplingConfig,
                   media_of: Callable[[int], vision_data.Media | None], seed: int = 0, min_rows: int = 1,
                   per_row: int | None = None) -> Decoder:
  """A Decoder over the K2.5 model: each context holds its episode's image block
  (`media_of(episode)`; None: a text-only episode, no block); per round the vision tower
  encodes the images of the rows (`per_row` patches a row, `media_rows.media_batch`), and the sampler
  splices the features into the placeholders at prefill. A round without images decodes
  text only."""
  rng = [jax.random.PRNGKey(seed)]

  def decode_turns(contexts, episodes):
    media_for = media_rows.rows_media(cfg, params, [media_of(e) for e in episodes], per_row)
    rng[0], key = jax.random.split(rng[0])
    return decode.turns(decode.decode(cfg.text, params[k25.LANGUAGE_MODEL], contexts, key, sampling,
                                      width_multiple=TURN_WIDTH_MULTIPLE, min_rows=min_rows, media_for=media_for))
  return decode_turns


def sandbox_pool(section) -> sandbox.SandboxPool:
  """The sandbox pool of a config's `sandbox` section: `sessions` at once, each call limited
  to `cpu_s`, `wall_s` and `memory_mb`."""
  return sandbox.SandboxPool(section.sessions, limits=sandbox.Limits(cpu_s=section.cpu_s, wall_s=section.wall_s,
                                                                      memory_mb=section.memory_mb))
