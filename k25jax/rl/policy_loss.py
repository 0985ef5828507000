"""The policy losses of the RL stages, by name (`loss.name`), over either model.

    logits, aux = forward(model, θ, rows)                       (K2.5: with the rows' media)
    logp        = log softmax(logits / T)[targets]              (rollout.token_logprobs, banned ids at −inf)
    L           = k25:   K2.5's Eq. 1 (losses.k25_policy_loss), the default
                  ppo:   clipped surrogate (losses.ppo_clip_loss)
                  grpo:  group-normalised advantages (losses.grpo_loss, from the rewards)
                  cispo: clipped importance-sampling weights (losses.cispo_loss)

over the rows of `rollout.loss_rows` with per-row `advantages` and `rewards` columns. A
minibatch whose advantages are 0 on every generated token (every group's rewards equal)
has no policy gradient, and the loss gates its update off (`step.UPDATE_GATE`).
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import ml_collections

from k25jax import losses
from k25jax.rl import rollout
from k25jax.train import objective, step

LOSSES = ("k25", "ppo", "grpo", "cispo")


def policy_loss(loss_config: ml_collections.ConfigDict, group_size: int):
  """(logp, rows) → (loss, metrics) for `loss.name` ∈ LOSSES."""
  name = loss_config.name
  if name not in LOSSES:
    raise ValueError(f"loss.name={name!r}; choose from {LOSSES}")
  if name == "k25":
    return lambda logp, b: losses.k25_policy_loss(
        logp, b["old_logp"], b["advantages"], b["mask"], alpha=loss_config.alpha, beta=loss_config.beta,
        tau=loss_config.tau, normalize=loss_config.normalize, group_size=group_size)
  if name == "ppo":
    return lambda logp, b: losses.ppo_clip_loss(
        logp, b["old_logp"], b["advantages"], b["mask"], eps=loss_config.eps, normalize=loss_config.normalize,
        group_size=group_size)
  if name == "cispo":
    return lambda logp, b: losses.cispo_loss(
        logp, b["old_logp"], b["advantages"], b["mask"], eps_high=loss_config.eps_high,
        normalize=loss_config.normalize, group_size=group_size)
  return lambda logp, b: losses.grpo_loss(logp, b["old_logp"], b["rewards"][:, 0], b["mask"],
                                          group_size=group_size, eps=loss_config.eps)


def make_loss(model, loss_config: ml_collections.ConfigDict, *, group_size: int, temperature: float,
              banned: Sequence[int] = ()):
  """loss_fn(params, rows, rng) → (L, (metrics, aux)) for the generic train step: the policy
  loss on the generated tokens, log π over the tokens the sampler may draw."""
  score = policy_loss(loss_config, group_size)

  def loss_fn(params, batch, rng):
    del rng
    logits, aux = objective.forward(model, params, batch)
    logp = rollout.token_logprobs(rollout.mask_banned(logits, banned), batch["targets"], temperature)
    loss, metrics = score(logp, batch)
    signal = jnp.any((batch["advantages"] != 0) & (batch["mask"] > 0))
    return loss, ({**metrics, step.UPDATE_GATE: signal.astype(jnp.float32)}, aux)
  return loss_fn
