"""The supervised objective, for the K2 decoder and the K2.5 model alike.

    hidden, aux = forward(model, θ, batch)        K2.5: with the batch's media when it has any
    L = CE(θ) + z · mean_t (log Z_t)² + α · L_balance          (losses.head_next_token_loss)

CE is the loss-masked next-token cross-entropy over packed rows (segment_ids, positions).
Metrics beside L: the MoE balance loss, the largest attention logit, the most loaded
expert over the mean load; for K2.5 whether the placeholders matched the media, and
on batches with vision samples (`is_vision`) how many whole answers are exact. The loss
takes the final hidden states and the LM head and never forms the [batch, seq, vocab]
logits (the model's logits go unused and XLA drops them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k25jax import losses
from k25jax.model import k25, transformer
from k25jax.train import multimodal


def forward(model: transformer.Transformer | k25.K25, params, batch: dict, return_hidden: bool = False):
  """(logits, aux) of `model` on a batch of packed rows (`inputs`, `positions`, `segment_ids`;
  for K2.5 also `pixel_values` and `layout` when the batch has media); aux["hidden"], the
  final normed hidden states, with `return_hidden`."""
  if isinstance(model, k25.K25):
    return model.apply({"params": params}, batch["inputs"], batch.get("pixel_values"), batch.get("layout"),
                       batch["positions"], batch["segment_ids"], return_hidden=return_hidden)
  return model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"],
                     return_hidden=return_hidden)


def head_kernel(model: transformer.Transformer | k25.K25, params) -> jax.Array:
  """The LM head's [hidden, vocab] kernel: `lm_head`, or the embedding's transpose when tied."""
  cfg = model.cfg.text if isinstance(model, k25.K25) else model.cfg
  decoder = params[k25.LANGUAGE_MODEL] if isinstance(model, k25.K25) else params
  return decoder["embed_tokens"]["embedding"].T if cfg.tie_word_embeddings else decoder["lm_head"]


def model_metrics(aux: dict) -> dict[str, jax.Array]:
  """Balance loss, max attention logit and max/mean expert load of a forward's aux."""
  load = aux["expert_load"]
  return {"balance_loss": aux["balance_loss"], "max_attention_logit": jnp.max(aux["max_logits"]),
          "expert_load_max_over_mean": jnp.max(load / jnp.maximum(load.mean(-1, keepdims=True), 1.0))
          if load.shape[0] else jnp.zeros(())}


def next_token(model: transformer.Transformer | k25.K25, *, z_loss: float = 0.0, balance_loss_alpha: float = 0.0,
               frozen: tuple[str, ...] = ()):
  """loss_fn(params, batch, rng) -> (L, (metrics, aux)), the equation above (α = 0 leaves the
  balance term out). `frozen` top-level params get no gradient (`stop_gradient`: their
  weight gradients are never computed)."""

  def loss_fn(params, batch, rng):
    del rng  # deterministic forward pass
    params = {name: jax.lax.stop_gradient(p) if name in frozen else p for name, p in params.items()}
    _, aux = forward(model, params, batch, return_hidden=True)
    loss, metrics, hits = losses.head_next_token_loss(aux.pop("hidden"), head_kernel(model, params),
                                                      batch["targets"], batch["loss_mask"], z_loss=z_loss)
    if balance_loss_alpha:
      loss = loss + balance_loss_alpha * aux["balance_loss"]
    metrics = {**metrics, **model_metrics(aux)}
    if isinstance(model, k25.K25):
      metrics["media_mismatch"] = jnp.asarray(aux.get("media_mismatch", False), jnp.float32)
      if "is_vision" in batch:
        metrics.update(multimodal.answer_metrics(hits, batch))
    return loss, (metrics, aux)

  return loss_fn


def for_section(model: transformer.Transformer | k25.K25, train, frozen: tuple[str, ...] = ()):
  """`next_token` with a config section's `z_loss` and `balance_loss_alpha` (the stage's `train`)."""
  return next_token(model, z_loss=train.z_loss, balance_loss_alpha=train.balance_loss_alpha, frozen=frozen)
