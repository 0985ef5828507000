"""One batched decode over `sampler.generate` for every caller: plain RL, tool rollouts, the swarm.

Contexts (token lists of different lengths) are right-padded into one [rows, width] batch
and decoded in ONE sampler call, each row at its own positions:

    width = the longest context rounded up to `width_multiple`, or (min_width > 0) to the next
            power of two of at least `min_width`; at most max_positions − max_new_tokens
    rows  = len(contexts), or (bucket_rows) the next power of two, at least `min_rows`, or
            (min_tokens > 0) at least min(min_rows, min_tokens // width): a wide call is not
            padded with rows it pays for as if they were real (on CPU a batch costs its rows)

so a run sees few distinct shapes and the sampler compiles a few times, not once per call.
Padding rows are one pad token long; what they generate is dropped.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from k25jax.model.config import ModelConfig
from k25jax.rl import sampler

# media_for(prompts [rows, width]) -> (features, placeholder mask): a K2.5 prompt's images (`sampler.generate`).
MediaFor = Callable[[np.ndarray], tuple]


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def bucket(n: int, at_least: int = 1) -> int:
  """The next power of two >= max(n, at_least)."""
  return 1 << (max(n, at_least, 1) - 1).bit_length()


def pad(contexts: Sequence[Sequence[int]], cfg: ModelConfig, sampling: sampler.SamplingConfig, *,
        width_multiple: int = 1, min_width: int = 0, min_rows: int = 1, min_tokens: int = 0,
        bucket_rows: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded prompts [rows, width] and their lengths (module docstring). Raises
  ValueError when a context leaves no room for `max_new_tokens`."""
  longest = max(len(c) for c in contexts)
  rounded = bucket(longest, min_width) if min_width else _round_up(longest, width_multiple)
  width = min(rounded, cfg.max_position_embeddings - sampling.max_new_tokens)
  if longest > width:
    raise ValueError(f"a context of {longest} tokens leaves no room for {sampling.max_new_tokens} new ones in "
                     f"max_position_embeddings={cfg.max_position_embeddings}")
  floor = min(min_rows, max(1, min_tokens // width)) if min_tokens else min_rows
  rows = bucket(len(contexts), floor) if bucket_rows else len(contexts)
  prompts = np.full((rows, width), sampling.pad_id, np.int32)
  lengths = np.ones(rows, np.int32)
  for i, c in enumerate(contexts):
    prompts[i, :len(c)], lengths[i] = c, len(c)
  return prompts, lengths


def decode(cfg: ModelConfig, params, contexts: Sequence[Sequence[int]], rng: jax.Array,
           sampling: sampler.SamplingConfig, *, width_multiple: int = 1, min_width: int = 0, min_rows: int = 1,
           min_tokens: int = 0, bucket_rows: bool = True, media_for: MediaFor | None = None
           ) -> dict[str, np.ndarray]:
  """One sampler call for all `contexts` (`pad`'s layout; `media_for` gives the padded rows'
  media). Returns the sampler's host arrays for the contexts' rows: tokens and logprobs
  [n, max_new_tokens], lengths [n] (the whole batch in every process)."""
  prompts, lengths = pad(contexts, cfg, sampling, width_multiple=width_multiple, min_width=min_width,
                         min_rows=min_rows, min_tokens=min_tokens, bucket_rows=bucket_rows)
  media = media_for(prompts) if media_for is not None else None
  out = sampler.generate(cfg, params, prompts, lengths, rng, sampling, media=media)
  out = multihost_utils.process_allgather(out, tiled=True) if jax.process_count() > 1 else jax.device_get(out)
  return {name: np.asarray(value)[:len(contexts)] for name, value in out.items()}


def turns(out: dict[str, np.ndarray]) -> list[tuple[list[int], list[float]]]:
  """Each row's generated (tokens, log-probs), up to and with its stop token."""
  return [(out["tokens"][i, :n].tolist(), out["logprobs"][i, :n].tolist()) for i, n in enumerate(out["lengths"])]
