"""Language-model losses, pure `jax.numpy` (no Flax): importable by any JAX project."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def first_argmax(logits: jax.Array) -> jax.Array:
  """argmax over the last axis (the lowest index attaining the max), as min{i : z_i = max_j z_j}.

  Two plain reductions, which XLA:CPU runs ~3x faster than argmax's variadic (value, index)
  reduce (16 ms of a training step's metrics at vocab 4096). A row holding NaN gives the
  vocabulary size, an index no target has.
  """
  vocab = logits.shape[-1]
  top = jnp.max(logits, axis=-1, keepdims=True)
  return jnp.min(jnp.where(logits == top, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def next_token_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array, *,
                    z_loss: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Masked next-token cross-entropy with an optional z-loss (PaLM).

      log Z_t = logsumexp_v z_{t,v}
      L = Σ_t w_t · ( log Z_t − z_{t, y_t}  +  z_loss · (log Z_t)² ) / max(Σ_t w_t, 1)

  logits: [..., vocab] (computed in float32); targets: int [...], the token that
  follows each position; weights: [...] float loss mask (0 on padding and on the
  last token of each packed document). Returns (L, metrics) with metrics
  `cross_entropy` (without the z term), `z_loss`, `accuracy` (argmax = target) and
  `tokens` (Σ w), all weighted means except `tokens`.
  """
  logits = logits.astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  tokens = jnp.sum(weights)
  denom = jnp.maximum(tokens, 1.0)
  cross_entropy = jnp.sum(weights * (log_z - target_logit)) / denom
  z_term = jnp.sum(weights * jnp.square(log_z)) / denom
  correct = (first_argmax(logits) == targets).astype(jnp.float32)
  metrics = {
      "cross_entropy": cross_entropy,
      "z_loss": z_term,
      "accuracy": jnp.sum(weights * correct) / denom,
      "tokens": tokens,
  }
  return cross_entropy + z_loss * z_term, metrics
