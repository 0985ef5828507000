"""Language-model losses, pure `jax.numpy` (no Flax): importable by any JAX project."""
from __future__ import annotations

import functools

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


def head_next_token_loss(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, weights: jax.Array, *,
                         z_loss: float = 0.0, chunk_bytes: int = 16 * 2**20):
  """`next_token_loss(hidden @ kernel, …)` without the [batch, seq, vocab] logits.

  hidden: [batch, seq, d]; kernel: [d, vocab] (the LM head); targets, weights: [batch, seq].
  The sequence is cut into chunks whose logits fit `chunk_bytes` (float32), and each chunk's
  logits live only while it is processed. Differentiated, the chunk also forms the gradient
  of L with respect to its logits,

      ∂L/∂z_{t,v} = (w_t / Σw) · ((1 + 2·z_loss·log Z_t) · softmax(z_t)_v − [v = y_t]),

  and reduces it at once to ∂L/∂hidden_t = Σ_v ∂L/∂z_{t,v} · kernel[:, v] and the chunk's share
  of ∂L/∂kernel = Σ_t hidden_t ⊗ ∂L/∂z_t: the same three matmuls as autodiff of the
  unfused loss, with no logits kept from the forward pass for the backward. Returns
  (L, metrics, hits): L and the metrics of `next_token_loss` (the metrics carry no gradient)
  and hits [batch, seq], whether each position's argmax is its target. The weights get no
  gradient.
  """
  b, s, _ = hidden.shape
  vocab = kernel.shape[-1]
  chunk = _sequence_chunk(b, s, vocab, chunk_bytes)
  loss, cross_entropy, z_term, correct, tokens, hits = _head_loss(
      hidden, kernel, targets, weights.astype(jnp.float32), float(z_loss), chunk)
  metrics = {"cross_entropy": cross_entropy, "z_loss": z_term, "accuracy": correct, "tokens": tokens}
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics), jax.lax.stop_gradient(hits) > 0


def _sequence_chunk(batch: int, seq: int, vocab: int, chunk_bytes: int) -> int:
  """The longest divisor c of seq with batch·c·vocab float32 logits within chunk_bytes (≥ 1)."""
  fits = max(1, chunk_bytes // (4 * batch * vocab))
  return max(c for c in range(1, min(seq, fits) + 1) if seq % c == 0)


def _by_chunk(x: jax.Array, chunk: int) -> jax.Array:
  """[batch, seq, ...] → [seq/chunk, batch, chunk, ...] (the batch axis stays whole per chunk)."""
  b, s = x.shape[:2]
  return jnp.moveaxis(x.reshape((b, s // chunk, chunk) + x.shape[2:]), 1, 0)


def _chunk_logits(h, kernel, t):
  """logits [b, c, V] (float32), log Z [b, c], the targets' logits and whether the argmax hits."""
  logits = jnp.einsum("bcd,dv->bcv", h, kernel.astype(h.dtype), preferred_element_type=jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, t[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return logits, log_z, target_logit, first_argmax(logits) == t


def _chunk_sums(log_z, target_logit, hit, w):
  return jnp.stack([jnp.sum(w * (log_z - target_logit)), jnp.sum(w * jnp.square(log_z)),
                    jnp.sum(w * hit.astype(jnp.float32))])


def _head_outputs(sums, tokens, z_loss, hits, shape):
  denom = jnp.maximum(tokens, 1.0)
  cross_entropy, z_term, correct = sums[0] / denom, sums[1] / denom, sums[2] / denom
  hits = jnp.moveaxis(hits, 0, 1).reshape(shape).astype(jnp.float32)        # back to [batch, seq]
  return cross_entropy + z_loss * z_term, cross_entropy, z_term, correct, tokens, hits


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_loss(hidden, kernel, targets, weights, z_loss, chunk):
  """(L, cross-entropy, z term, accuracy, tokens, hits) of the chunked head; no gradients formed."""
  def body(sums, xs):
    h, t, w = xs
    _, log_z, target_logit, hit = _chunk_logits(h, kernel, t)
    return sums + _chunk_sums(log_z, target_logit, hit, w), hit

  sums, hits = jax.lax.scan(body, jnp.zeros(3, jnp.float32),
                            (_by_chunk(hidden, chunk), _by_chunk(targets, chunk), _by_chunk(weights, chunk)))
  return _head_outputs(sums, jnp.sum(weights), z_loss, hits, targets.shape)


def _head_loss_fwd(hidden, kernel, targets, weights, z_loss, chunk):
  tokens = jnp.sum(weights)
  scale = 1.0 / jnp.maximum(tokens, 1.0)

  def body(carry, xs):
    sums, d_kernel = carry
    h, t, w = xs
    logits, log_z, target_logit, hit = _chunk_logits(h, kernel, t)
    probs = jnp.exp(logits - log_z[..., None]) * (1.0 + 2.0 * z_loss * log_z)[..., None]
    d_logits = (probs - jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)) * (w * scale)[..., None]
    d_logits = d_logits.astype(h.dtype)
    d_h = jnp.einsum("bcv,dv->bcd", d_logits, kernel.astype(h.dtype), preferred_element_type=jnp.float32)
    d_kernel = d_kernel + jnp.einsum("bcd,bcv->dv", h, d_logits, preferred_element_type=jnp.float32)
    return (sums + _chunk_sums(log_z, target_logit, hit, w), d_kernel), (d_h.astype(h.dtype), hit)

  init = (jnp.zeros(3, jnp.float32), jnp.zeros(kernel.shape, jnp.float32))
  (sums, d_kernel), (d_hidden, hits) = jax.lax.scan(
      body, init, (_by_chunk(hidden, chunk), _by_chunk(targets, chunk), _by_chunk(weights, chunk)))
  d_hidden = jnp.moveaxis(d_hidden, 0, 1).reshape(hidden.shape)
  outputs = _head_outputs(sums, tokens, z_loss, hits, targets.shape)
  return outputs, (d_hidden, d_kernel.astype(kernel.dtype))


def _head_loss_bwd(z_loss, chunk, saved, cotangents):
  """Only L's cotangent flows back; the other outputs are metrics (`head_next_token_loss` stops
  them). The targets and the weights get none."""
  d_hidden, d_kernel = saved
  g = cotangents[0]
  return (g * d_hidden).astype(d_hidden.dtype), (g * d_kernel).astype(d_kernel.dtype), None, None


_head_loss.defvjp(_head_loss_fwd, _head_loss_bwd)
