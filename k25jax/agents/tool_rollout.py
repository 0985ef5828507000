"""Multi-turn rollouts of a chat model with the sandboxed Python tool (`k25jax.agents.sandbox`).

An episode starts from `BOS <|user|> [media] question <|end|> <|assistant|>` and runs
in rounds; in each round every unfinished episode gets one assistant turn, all of them
decoded in ONE batched call, and then all their tool calls run at once in their own
sandbox sessions (one persistent session per episode, opened at its first call):

    turn = decode(context)                                       (tokens under the loss)
    call   → context += turn <|tool|> output <|end|> <|assistant|>   (output: stdout, or "Error: ...")
    answer → the episode ends; its answer is the turn's text
    ends also at `max_turns` turns, when the next turn would not fit in `max_context`
    tokens, or on a turn without <|end|> (truncated)

A malformed call (empty code, a role token inside it) or a call when the tool is off
gets an error observation, never a crash. Metrics (`summarize`): answer accuracy,
tool-call success rate (calls whose code ran without error / calls made), calls and
turns per episode, and how episodes finished.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k25jax.data import chat, image_tasks
from k25jax.data import vision as vision_data
from k25jax.model import k25, media as media_lib, vision
from k25jax.model.config import K25Config, ModelConfig
from k25jax.rl import sampler

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
class Transcript:
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


def banned_tokens(tok: chat.ChatTokenizer) -> tuple[int, ...]:
  """Tokens the model may never write: the media tokens (a placeholder it wrote would take an
  image's features). Sampling drops them, and so must the loss's log π (`mask_banned`)."""
  return tuple(tok.media or ())


def mask_banned(logits: jax.Array, banned: Sequence[int]) -> jax.Array:
  """logits with the `banned` ids at −inf: the distribution the sampler draws from."""
  return logits.at[..., jnp.asarray(banned, jnp.int32)].set(-jnp.inf) if banned else logits


def prompt(tok: chat.ChatTokenizer, question: str, media: Sequence[int] = ()) -> list[int]:
  """`BOS <|user|> [media] question <|end|> <|assistant|>`: an episode's first context."""
  tokens, _ = chat.render(tok, [chat.Message("user", question, prefix=tuple(media))])
  return tokens + [tok.assistant_id]


def observation(result, max_chars: int) -> str:
  """A tool result as the text the model reads: stdout (and the last expression's value,
  if any), or `Error: ...`; cut to `max_chars`."""
  if result.ok:
    text = result.stdout.rstrip("\n")
    if result.value is not None:
      text = f"{text}\n{result.value}" if text else str(result.value)
  else:
    text = f"Error: {result.error}"
  return text if len(text) <= max_chars else text[:max_chars - 3] + "..."


def _append(t: Transcript, tokens: Sequence[int], mask: float, logprobs: Sequence[float] | None = None) -> None:
  t.tokens += list(tokens)
  t.loss_mask += [mask] * len(tokens)
  t.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)


async def _play(decode: Decoder, tok: chat.ChatTokenizer, tasks: Sequence[image_tasks.ImageTask],
                prompts: Sequence[Sequence[int]], pool, config: RolloutConfig) -> list[Transcript]:
  transcripts = [Transcript(list(p), [0.0] * len(p), [0.0] * len(p), len(p)) for p in prompts]
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
      calls: dict[int, str] = {}
      errors: dict[int, str] = {}
      for i, (tokens, logprobs) in zip(active, generated):
        t = transcripts[i]
        turn = chat.parse_turn(tok, tokens)
        _append(t, turn.tokens, 1.0, logprobs[:len(turn.tokens)])
        t.turns += 1
        if turn.error == "truncated":
          t.finish = "truncated"
        elif not turn.call:
          t.answer, t.finish = (None if turn.error else turn.text.strip()), "answer"
        else:
          t.calls += 1
          t.call_errors += 1 if (turn.error or not config.tool) else 0
          if turn.error:
            errors[i] = f"Error: malformed call ({turn.error})"
          elif not config.tool:
            errors[i] = "Error: no tool is available in this task"
          else:
            calls[i] = turn.text
      for i in calls:
        if i not in sessions:
          sessions[i] = await stack.enter_async_context(pool.session(images=tasks[i].images))
      results = await asyncio.gather(*(sessions[i].arun(code) for i, code in calls.items()))
      outputs = dict(errors)
      for i, result in zip(calls, results):
        outputs[i] = observation(result, config.output_chars)
        transcripts[i].call_errors += 0 if result.ok else 1
      for i, text in outputs.items():
        t = transcripts[i]
        tool_message, _ = chat.message_tokens(tok, chat.Message("tool", text))
        _append(t, tool_message + [tok.assistant_id], 0.0)
        if t.turns >= config.max_turns:
          t.finish = "turn_limit"
  return transcripts


def play(decode: Decoder, tok: chat.ChatTokenizer, tasks: Sequence[image_tasks.ImageTask], pool,
         config: RolloutConfig, media: Sequence[Sequence[int]] | None = None) -> list[Transcript]:
  """Plays one episode per task to the end, in waves of `pool.max_sessions` episodes (each
  episode may hold a session until it ends). `media[i]` (optional) are token ids placed
  before task i's question (its image block, for a vision model). The decoder gets the
  episodes' indices into `tasks`."""
  media = media if media is not None else [()] * len(tasks)
  prompts = [prompt(tok, task.question, m) for task, m in zip(tasks, media)]
  transcripts = []
  for start in range(0, len(tasks), pool.max_sessions):
    wave = range(start, min(start + pool.max_sessions, len(tasks)))
    offset_decode = lambda contexts, episodes, s=start: decode(contexts, [s + e for e in episodes])
    transcripts += asyncio.run(_play(offset_decode, tok, [tasks[i] for i in wave], [prompts[i] for i in wave],
                                     pool, config))
  return transcripts


def summarize(transcripts: Sequence[Transcript], tasks: Sequence[image_tasks.ImageTask]) -> dict[str, float]:
  """accuracy, tool_call_success (calls that ran without error / calls; nan if none),
  calls and turns per episode, length (generated tokens), and the share of each finish."""
  correct = [image_tasks.grade(t.answer, task.answer) for t, task in zip(transcripts, tasks)]
  calls = sum(t.calls for t in transcripts)
  out = {"accuracy": float(np.mean(correct)),
         "tool_call_success": (calls - sum(t.call_errors for t in transcripts)) / calls if calls else float("nan"),
         "calls_per_episode": calls / len(transcripts),
         "turns_per_episode": float(np.mean([t.turns for t in transcripts])),
         "generated_tokens": float(np.mean([sum(t.loss_mask) for t in transcripts]))}
  for finish in FINISHES:
    out[f"finish/{finish}"] = float(np.mean([t.finish == finish for t in transcripts]))
  for kind in image_tasks.KINDS:
    chosen = [c for c, task in zip(correct, tasks) if task.kind == kind]
    if chosen:
      out[f"{kind}/accuracy"] = float(np.mean(chosen))
  return out


# ------------------------------------------------------------------------------ decoders
def _bucket(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def pad_contexts(contexts: Sequence[Sequence[int]], cfg: ModelConfig, sampling: sampler.SamplingConfig,
                 min_rows: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded prompts [rows, width] and their lengths: width a multiple of 64 tokens,
  rows a power of two and at least `min_rows`, so the sampler compiles for few shapes."""
  longest = max(len(c) for c in contexts)
  width = min(_bucket(longest, 64), cfg.max_position_embeddings - sampling.max_new_tokens)
  if longest > width:
    raise ValueError(f"a context of {longest} tokens leaves no room for {sampling.max_new_tokens} new ones in "
                     f"max_position_embeddings={cfg.max_position_embeddings}")
  rows = max(1 << (len(contexts) - 1).bit_length(), min_rows)
  prompts = np.full((rows, width), sampling.pad_id, np.int32)
  lengths = np.ones(rows, np.int32)
  for i, c in enumerate(contexts):
    prompts[i, :len(c)], lengths[i] = c, len(c)
  return prompts, lengths


def _turns(out: dict, n: int) -> list[tuple[list[int], list[float]]]:
  out = jax.device_get(out)
  return [(out["tokens"][i, :out["lengths"][i]].tolist(), out["logprobs"][i, :out["lengths"][i]].tolist())
          for i in range(n)]


def text_decoder(cfg: ModelConfig, params, sampling: sampler.SamplingConfig, seed: int = 0,
                 min_rows: int = 1) -> Decoder:
  """A Decoder over the text model: one sampler call per round (`pad_contexts`; min_rows =
  the wave size keeps one row count per run)."""
  rng = [jax.random.PRNGKey(seed)]

  def decode(contexts, episodes):
    del episodes
    prompts, lengths = pad_contexts(contexts, cfg, sampling, min_rows)
    rng[0], key = jax.random.split(rng[0])
    return _turns(sampler.generate(cfg, params, prompts, lengths, key, sampling), len(contexts))
  return decode


def media_batch(items: Sequence[vision_data.Media], cfg: K25Config, rows: int
                ) -> tuple[np.ndarray, vision.PatchLayout]:
  """Pixel values of `items` (one per row, in row order) zero-padded to `rows` × the largest
  item's patches, and their PatchLayout padded alike (one compilation per row count)."""
  pixels, grids = vision_data.pack_media(items)
  per_row = max(m.pixel_values.shape[0] for m in items)
  budget = rows * per_row
  padded = np.zeros((budget,) + pixels.shape[1:], np.float32)
  padded[:len(pixels)] = pixels
  kh, kw = cfg.vision.merge_kernel_size
  return padded, vision.patch_layout(grids, cfg.vision, num_patches=budget, num_merged=budget // (kh * kw))


@functools.partial(jax.jit, static_argnames=("cfg",))
def encode_media(params, pixel_values, layout: vision.PatchLayout, *, cfg: K25Config) -> jax.Array:
  """The projector outputs of a padded media batch [num_merged, text hidden] (`K25.encode_media`)."""
  return k25.K25(cfg).apply({"params": params}, pixel_values, layout, method=k25.K25.encode_media)


def vision_decoder(cfg: K25Config, params, sampling: sampler.SamplingConfig,
                   media_of: Callable[[int], vision_data.Media], seed: int = 0, min_rows: int = 1) -> Decoder:
  """A Decoder over the K2.5 model: each context holds its episode's image block
  (`media_of(episode)`); per round the vision tower encodes the images of the rows, and
  the sampler splices the features into the placeholders at prefill."""
  rng = [jax.random.PRNGKey(seed)]

  def decode(contexts, episodes):
    prompts, lengths = pad_contexts(contexts, cfg.text, sampling, min_rows)
    items = [media_of(e) for e in episodes]
    pixels, layout = media_batch(items, cfg, len(prompts))
    mask = media_lib.placeholder_mask(prompts, cfg.media_token_ids)
    media_lib.check_placeholders(mask, [m.num_tokens for m in items])
    features = encode_media(params, pixels, layout, cfg=cfg)
    rng[0], key = jax.random.split(rng[0])
    out = sampler.generate(cfg.text, params["language_model"], prompts, lengths, key, sampling,
                           media=(features, jnp.asarray(mask)))
    return _turns(out, len(contexts))
  return decode


def loss_rows(transcripts: Sequence[Transcript], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """Transcripts → next-token rows [n, seq_len]: inputs, targets, positions, segment_ids,
  `mask` (1 where the target is a generated token) and `old_logp` (its sampling log-prob).
  Longer transcripts are cut at seq_len + 1 tokens."""
  n = len(transcripts)
  tokens = np.full((n, seq_len + 1), pad_id, np.int32)
  mask = np.zeros((n, seq_len + 1), np.float32)
  old = np.zeros((n, seq_len + 1), np.float32)
  lengths = np.zeros(n, np.int32)
  for i, t in enumerate(transcripts):
    m = min(len(t.tokens), seq_len + 1)
    tokens[i, :m], mask[i, :m], old[i, :m], lengths[i] = t.tokens[:m], t.loss_mask[:m], t.logprobs[:m], m
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (n, seq_len))
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask[:, 1:], "old_logp": old[:, 1:],
          "positions": positions, "segment_ids": (positions < lengths[:, None] - 1).astype(np.int32)}
