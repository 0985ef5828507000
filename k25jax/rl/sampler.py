"""Batched generation on the MLA latent cache: jitted prefill, then a compiled decode loop.

    out = sampler.generate(model_cfg, params, prompts, prompt_lengths, rng, SamplingConfig(...))
    out["tokens"]   [b, max_new_tokens]  generated tokens, `pad_id` after a stop token
    out["logprobs"] [b, max_new_tokens]  log π(token) under the sampling distribution (0 after stop)
    out["lengths"]  [b]                  generated tokens per row, the stop token included

    for token, logprob in sampler.stream(model_cfg, params, prompt, prompt_length, rng, SamplingConfig(...)):
        ...                                one prompt [1, P], a token at a time (to show it as it comes)

Prompts are right-padded [b, P] with their true lengths; each row decodes at its own
positions (row b's first new token sits at position prompt_lengths[b]), so rows of
different lengths share one batch without left-padding. Only the latent and the rope
key are cached (`attention.init_cache`).

The recorded log-prob is log softmax(logits / T)[token] for temperature T > 0 (top-k /
top-p truncation is a sampling device and is not renormalised into it), and
log softmax(logits)[token] for greedy decoding (T = 0): the π_old of the RL loss.
`banned_tokens` are removed from the distribution before sampling and scoring.
The temperature and the banned tokens enter the compiled program as values (`Knobs`), not
as its shape: greedy, sampled and banned decodes of one batch shape share one program.

Several processes (jax.distributed): every process calls `generate` with the same prompts,
key and media mask; they enter as arrays replicated over the params' mesh, so the processes
run ONE decode over all devices and each can read the whole result (`decode.decode`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from k25jax import losses
from k25jax.model import attention, transformer
from k25jax.model.config import ModelConfig
from k25jax.train import sharding


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  max_new_tokens: int
  temperature: float = 1.0      # 0 = greedy
  top_k: int = 0                # 0 = off
  top_p: float = 1.0            # 1 = off
  stop_tokens: tuple[int, ...] = ()
  pad_id: int = 0
  banned_tokens: tuple[int, ...] = ()   # never sampled (e.g. tools a baseline may not use)

  def __post_init__(self):
    if self.max_new_tokens <= 0:
      raise ValueError(f"SamplingConfig.max_new_tokens must be positive, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingConfig.top_p must lie in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k must be >= 0, got {self.top_k}")

  @property
  def program(self) -> "SamplingConfig":
    """What the compiled sampler depends on: this config less its `Knobs` (temperature, bans)."""
    return dataclasses.replace(self, temperature=1.0, banned_tokens=())


def truncate_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Sets to −inf the logits outside the top-k, then outside the smallest top-p nucleus."""
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(mass_before < top_p, sorted_logits, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return logits


@dataclasses.dataclass(frozen=True)
class Knobs:
  """A SamplingConfig's temperature and banned tokens as arrays: what the compiled sampler
  reads at run time (`SamplingConfig.program` is the rest, its compile-time shape)."""

  temperature: jax.Array   # [] float32; 0 = greedy
  ban: jax.Array           # [vocab] float32: −inf at banned ids, 0 elsewhere

  @classmethod
  def of(cls, sampling: SamplingConfig, vocab_size: int) -> "Knobs":
    outside = [t for t in sampling.banned_tokens if not 0 <= t < vocab_size]
    if outside:
      raise ValueError(f"SamplingConfig.banned_tokens {outside} lie outside the vocabulary of {vocab_size} ids")
    ban = np.zeros(vocab_size, np.float32)
    ban[list(sampling.banned_tokens)] = -np.inf
    return cls(np.float32(sampling.temperature), ban)


jax.tree_util.register_dataclass(Knobs, data_fields=["temperature", "ban"], meta_fields=[])


def sample_token(logits: jax.Array, rng: jax.Array, sampling: SamplingConfig, knobs: Knobs
                 ) -> tuple[jax.Array, jax.Array]:
  """logits [b, vocab] → (token [b] int32, log-prob [b] float32), with z = logits + ban:

      T > 0:  token ~ softmax(truncate(z / T)),   log-prob = log softmax(z / T)[token]
      T = 0:  token = argmax z (lowest index),    log-prob = log softmax(z)[token]
  """
  logits = logits.astype(jnp.float32) + knobs.ban
  greedy = knobs.temperature == 0
  scaled = logits / jnp.where(greedy, 1.0, knobs.temperature)
  token = jax.lax.cond(   # one branch runs: no random draw when greedy, no argmax when sampling
      greedy, lambda: losses.first_argmax(logits).astype(jnp.int32),
      lambda: jax.random.categorical(rng, truncate_logits(scaled, sampling.top_k, sampling.top_p),
                                     axis=-1).astype(jnp.int32))
  logp = jax.nn.log_softmax(scaled, axis=-1)
  return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def check_lengths(cfg: ModelConfig, prompt_len: int, sampling: SamplingConfig) -> None:
  total = prompt_len + sampling.max_new_tokens
  if total > cfg.max_position_embeddings:
    raise ValueError(f"prompt of {prompt_len} tokens + max_new_tokens={sampling.max_new_tokens} exceeds the "
                     f"context of {cfg.max_position_embeddings} (max_position_embeddings)")


def decode_step(model: transformer.Transformer, params, tokens: jax.Array, positions: jax.Array, cache: list[dict]
                ) -> tuple[jax.Array, list[dict]]:
  """One new token a row over the latent cache: tokens, positions [b, 1] → (logits [b, vocab]
  float32, the cache with the tokens' latents written at their positions)."""
  logits, aux = model.apply({"params": params}, tokens, positions, cache=cache)
  return logits[:, 0], aux["cache"]


def prefill(model: transformer.Transformer, params, prompts: jax.Array, prompt_lengths: jax.Array, cache_len: int,
            media=None) -> tuple[jax.Array, list[dict]]:
  """Runs right-padded prompts [b, P] through the model into a fresh cache of `cache_len`
  positions: (the logits after each row's last prompt token [b, vocab], the cache)."""
  batch, prompt_len = prompts.shape
  cache = attention.init_cache(model.cfg, batch, cache_len, jnp.dtype(model.cfg.dtype))
  positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
  logits, aux = model.apply({"params": params}, prompts, positions, cache=cache, media=media)
  return jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0], aux["cache"]


def advance(model: transformer.Transformer, params, last: jax.Array, cache: list[dict], positions: jax.Array,
            rng: jax.Array, sampling: SamplingConfig, knobs: Knobs, done: jax.Array | None = None):
  """One token a row: splits `rng`, samples from `last` [b, vocab] (`pad_id` where `done`) and
  runs the token at `positions` [b] through the model. Returns (token [b], log-prob [b], the
  next logits, the cache, the carried key): the step of `generate` and of `stream` alike."""
  rng, key = jax.random.split(rng)
  token, logp = sample_token(last, key, sampling, knobs)
  if done is not None:
    token = jnp.where(done, sampling.pad_id, token)
  last, cache = decode_step(model, params, token[:, None], positions[:, None], cache)
  return token, logp, last, cache, rng


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"))
def _generate(params, prompts, prompt_lengths, rng, knobs: Knobs, media=None, *, cfg: ModelConfig,
              sampling: SamplingConfig):
  model = transformer.Transformer(cfg)
  batch, prompt_len = prompts.shape
  n_new = sampling.max_new_tokens
  last, cache = prefill(model, params, prompts, prompt_lengths, prompt_len + n_new, media)
  stop = jnp.asarray(sampling.stop_tokens or (-1,), jnp.int32)

  def body(carry):
    step, cache, last, tokens, logps, done, rng = carry
    token, logp, last, cache, rng = advance(model, params, last, cache, prompt_lengths + step, rng, sampling, knobs,
                                            done)
    tokens = tokens.at[:, step].set(token)
    logps = logps.at[:, step].set(jnp.where(done, 0.0, logp))
    done = done | jnp.isin(token, stop)
    return step + 1, cache, last, tokens, logps, done, rng

  def cond(carry):
    step, *_, done, _ = carry
    return (step < n_new) & ~jnp.all(done)

  init = (jnp.int32(0), cache, last, jnp.full((batch, n_new), sampling.pad_id, jnp.int32),
          jnp.zeros((batch, n_new), jnp.float32), jnp.zeros((batch,), bool), rng)
  _, _, _, tokens, logps, _, _ = jax.lax.while_loop(cond, body, init)
  written = jnp.arange(n_new)[None, :]
  is_stop = jnp.isin(tokens, stop)
  first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, n_new)
  tokens = jnp.where(written < first_stop[:, None], tokens, sampling.pad_id)
  return {"tokens": tokens, "logprobs": jnp.where(written < first_stop[:, None], logps, 0.0),
          "lengths": first_stop.astype(jnp.int32)}


def generate(cfg: ModelConfig, params, prompts, prompt_lengths, rng: jax.Array,
             sampling: SamplingConfig, media=None) -> dict[str, jax.Array]:
  """Samples up to `max_new_tokens` per row after right-padded `prompts` [b, P].

  media: None, or (features [n, hidden], mask bool [b, P]) spliced into the prompts'
  placeholder rows at prefill (a K2.5 prompt's images; `params` are the language model's).
  """
  prompts = jnp.asarray(prompts, jnp.int32)
  prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
  if prompts.ndim != 2 or prompt_lengths.shape != prompts.shape[:1]:
    raise ValueError(f"prompts must be [batch, P] with prompt_lengths [batch]; got {prompts.shape} "
                     f"and {prompt_lengths.shape}")
  lengths = np.asarray(prompt_lengths)
  if lengths.min() < 1 or lengths.max() > prompts.shape[1]:
    raise ValueError(f"prompt_lengths must lie in [1, {prompts.shape[1]}], got {lengths.tolist()}")
  check_lengths(cfg, prompts.shape[1], sampling)
  knobs = Knobs.of(sampling, cfg.vocab_size)
  prompts, prompt_lengths, rng, knobs = on_params_mesh(params, (prompts, prompt_lengths, rng, knobs))
  if media is not None:
    features, mask = media
    media = features, on_params_mesh(params, np.asarray(mask))
  return _generate(params, prompts, prompt_lengths, rng, knobs, media, cfg=cfg, sampling=sampling.program)


def compiled_programs() -> int:
  """How many decode programs `generate` has compiled in this process (one per batch shape,
  model and `SamplingConfig.program`): a caller that times decoding can tell a compile in it."""
  return _generate._cache_size()


@functools.partial(jax.jit, static_argnames=("cfg", "cache_len"))
def _prefill(params, prompts, prompt_lengths, media=None, *, cfg: ModelConfig, cache_len: int):
  return prefill(transformer.Transformer(cfg), params, prompts, prompt_lengths, cache_len, media)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
def _advance(params, last, cache, positions, rng, knobs: Knobs, *, cfg: ModelConfig, sampling: SamplingConfig):
  return advance(transformer.Transformer(cfg), params, last, cache, positions, rng, sampling, knobs)


def stream(cfg: ModelConfig, params, prompt: np.ndarray, prompt_length: int, rng: jax.Array,
           sampling: SamplingConfig, media=None) -> Iterator[tuple[int, float]]:
  """Samples after one right-padded prompt [1, P] of `prompt_length` tokens a token at a time,
  for a caller that shows each as it comes: yields (token, log-prob) through the first stop
  token, at most `max_new_tokens`. The steps are `generate`'s (`prefill`, then `advance` with
  the key split the same way), run from Python; `media` as in `generate`. One process."""
  check_lengths(cfg, prompt.shape[1], sampling)
  last, cache = _prefill(params, np.asarray(prompt, np.int32), np.asarray([prompt_length], np.int32), media, cfg=cfg,
                         cache_len=prompt.shape[1] + sampling.max_new_tokens)
  knobs = Knobs.of(sampling, cfg.vocab_size)
  for step in range(sampling.max_new_tokens):
    token, logp, last, cache, rng = _advance(params, last, cache, np.asarray([prompt_length + step], np.int32), rng,
                                             knobs, cfg=cfg, sampling=sampling.program)
    token = int(token[0])
    yield token, float(logp[0])
    if token in sampling.stop_tokens:
      return


def replicated_like(params, host_values):
  """`host_values` (the same on every process) replicated over the mesh of `params`."""
  mesh = jax.tree.leaves(params)[0].sharding.mesh
  return sharding.from_host(jax.tree.map(np.asarray, host_values), sharding.replicated(mesh))


def on_params_mesh(params, host_values):
  """`host_values` ready to enter a jit beside `params`: as they are in one process; with
  several, replicated over the params' mesh (every process passes the same values)."""
  return replicated_like(params, host_values) if jax.process_count() > 1 else host_values
