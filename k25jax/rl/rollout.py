"""Rollouts → the arrays the policy loss reads.

A rollout row is prompt p (length n_p) followed by the sampled response y (length n_y,
the stop token included). The loss scores y's tokens only:

    logp[b, t] = log softmax(z_{b,t} / T)[x_{b,t+1}]   for t+1 ∈ [n_p, n_p + n_y)

with z the logits of the full sequence x = p ⧺ y and T the sampling temperature (the
same distribution the sampler recorded as π_old).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def pack(prompts: np.ndarray, prompt_lengths: np.ndarray, responses: np.ndarray,
         response_lengths: np.ndarray, old_logprobs: np.ndarray, pad_id: int) -> dict[str, np.ndarray]:
  """Right-padded rows x = p ⧺ y, shifted for next-token scoring.

  Returns inputs/targets/positions/segment_ids int32 [b, L−1], `mask` float32 [b, L−1]
  (1 where the target is a response token) and `old_logp` float32 [b, L−1] aligned with it.
  """
  batch = len(prompts)
  total = prompts.shape[1] + responses.shape[1]
  x = np.full((batch, total), pad_id, np.int32)
  mask = np.zeros((batch, total), np.float32)
  old = np.zeros((batch, total), np.float32)
  for b in range(batch):
    n_p, n_y = int(prompt_lengths[b]), int(response_lengths[b])
    x[b, :n_p] = prompts[b, :n_p]
    x[b, n_p:n_p + n_y] = responses[b, :n_y]
    mask[b, n_p:n_p + n_y] = 1.0
    old[b, n_p:n_p + n_y] = old_logprobs[b, :n_y]
  seq = total - 1
  positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
  lengths = np.asarray(prompt_lengths) + np.asarray(response_lengths)
  return {"inputs": x[:, :-1], "targets": x[:, 1:], "mask": mask[:, 1:], "old_logp": old[:, 1:],
          "positions": positions, "segment_ids": (positions < lengths[:, None]).astype(np.int32)}


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
  """log softmax(logits / T)[target] per position, float32 [b, t] (T = 0 means greedy: T = 1)."""
  scaled = logits.astype(jnp.float32) / (temperature or 1.0)
  return jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), targets[..., None], axis=-1)[..., 0]
