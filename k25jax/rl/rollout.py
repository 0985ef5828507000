"""Rollouts → the rows the policy loss reads, and the log-probs it recomputes.

A rollout is a token sequence x of length L with a loss mask (1 on the tokens the policy
generated: a response, or an agent's turns; 0 on the prompt and on observations) and the
log-probs the sampler recorded for the generated tokens (π_old). As a next-token row of
width S (x cut at S + 1 tokens):

    inputs[t] = x_t,  targets[t] = x_{t+1},  mask[t] = m_{t+1},  old_logp[t] = log π_old(x_{t+1})
    segment_ids[t] = 1 for t < L − 1 (positions whose target is in x), 0 after (padding)

as the packers of pre-training and SFT lay out rows: the last token of x is a target only.
The loss scores the generated tokens:

    logp[b, t] = log softmax(z_{b,t} / T)[x_{b,t+1}]    where mask[b, t] = 1

with z the logits of the full row and T the sampling temperature (the distribution the
sampler recorded), over the tokens the sampler may draw (`mask_banned`).
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class Scored(Protocol):
  """A rollout: its tokens, loss mask (1 on generated tokens) and their sampling log-probs."""

  tokens: Sequence[int]
  loss_mask: Sequence[float]
  logprobs: Sequence[float]


@dataclasses.dataclass(frozen=True)
class Response:
  """A prompt followed by one sampled response (plain RL)."""

  tokens: list[int]
  loss_mask: list[float]
  logprobs: list[float]


def responses(prompts: np.ndarray, prompt_lengths: np.ndarray, tokens: np.ndarray, lengths: np.ndarray,
              logprobs: np.ndarray) -> list[Response]:
  """Sampler output → rollouts p ⧺ y: prompt b (its first prompt_lengths[b] tokens) followed by
  response b (its first lengths[b] tokens, the stop token included), the loss on y."""
  out = []
  for b in range(len(prompts)):
    n_p, n_y = int(prompt_lengths[b]), int(lengths[b])
    out.append(Response([int(t) for t in prompts[b, :n_p]] + [int(t) for t in tokens[b, :n_y]],
                        [0.0] * n_p + [1.0] * n_y, [0.0] * n_p + [float(x) for x in logprobs[b, :n_y]]))
  return out


def loss_rows(rollouts: Sequence[Scored], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """Rollouts → next-token rows [n, seq_len] (module docstring): inputs, targets, positions,
  segment_ids int32; mask and old_logp float32. Longer rollouts are cut at seq_len + 1 tokens."""
  n = len(rollouts)
  tokens = np.full((n, seq_len + 1), pad_id, np.int32)
  mask = np.zeros((n, seq_len + 1), np.float32)
  old = np.zeros((n, seq_len + 1), np.float32)
  lengths = np.zeros(n, np.int32)
  for i, r in enumerate(rollouts):
    m = min(len(r.tokens), seq_len + 1)
    tokens[i, :m], mask[i, :m], old[i, :m], lengths[i] = r.tokens[:m], r.loss_mask[:m], r.logprobs[:m], m
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (n, seq_len))
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask[:, 1:], "old_logp": old[:, 1:],
          "positions": positions, "segment_ids": (positions < lengths[:, None] - 1).astype(np.int32)}


def bucketed_width(rollouts: Sequence[Scored], multiple: int, limit: int) -> int:
  """The row width `loss_rows` needs for the longest rollout (L − 1), rounded up to a multiple
  of `multiple` and at most `limit`: the update step then compiles once per bucket and
  computes no columns that are all padding."""
  longest = max((len(r.tokens) for r in rollouts), default=2) - 1
  return min(limit, -(-max(longest, 1) // multiple) * multiple)


def mask_banned(logits: jax.Array, banned: Sequence[int]) -> jax.Array:
  """logits with the `banned` ids at −inf: the distribution a sampler with `banned_tokens` draws from."""
  return logits.at[..., jnp.asarray(banned, jnp.int32)].set(-jnp.inf) if banned else logits


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
  """log softmax(logits / T)[target] per position, float32 [b, t] (T = 0 means greedy: T = 1)."""
  scaled = logits.astype(jnp.float32) / (temperature or 1.0)
  return jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), targets[..., None], axis=-1)[..., 0]
