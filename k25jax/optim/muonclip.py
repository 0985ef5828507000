"""MuonClip (Kimi K2): Muon with QK-Clip for MLA, AdamW for the rest.

Per step, with the parameters partitioned by `k25jax.optim.partition`:

    W ← W − η (O + λ W)                                Muon matrices (k25jax.optim.muon)
    W ← W − η (m̂ / (sqrt(v̂) + ε) + λ W)               AdamW (λ on matrices only)
    b ← b                                              e_score_correction_bias (frozen)

then QK-Clip, per layer l and head h, from the largest pre-softmax logit S of the step:

    γ = τ / S   if S > τ   else 1
    q_nope,h ← sqrt(γ) q_nope,h    k_nope,h ← sqrt(γ) k_nope,h    q_rope,h ← γ q_rope,h

so every logit of head h, s = scale·(q_nope·k_nope + q_rope·k_rope), becomes γ·s. The
shared rope key (kv_a_proj_with_mqa) and v are left alone. Usage:

    tx = muonclip.muonclip(schedule, weight_decay=0.1)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    params, clip_metrics = muonclip.qk_clip(params, aux["max_logits"], tau=100.0)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from k25jax.model.transformer import SCANNED
from k25jax.optim import partition
from k25jax.optim.muon import NS_COEFFS, muon


def muonclip(learning_rate: optax.ScalarOrSchedule, *, weight_decay: float = 0.1,
             momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, ns_coeffs=NS_COEFFS,
             rms_scale: float = 0.2, adam_b1: float = 0.9, adam_b2: float = 0.95,
             adam_eps: float = 1e-8) -> optax.GradientTransformation:
  """The update of the module docstring (QK-Clip is applied after it by `qk_clip`).

  One learning rate for both halves: the RMS scaling makes Muon's updates AdamW-sized.
  """
  adamw = optax.adamw(learning_rate, b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=weight_decay,
                      mask=partition.matrix_mask)
  return optax.partition(
      {partition.MUON: muon(learning_rate, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                          ns_coeffs=ns_coeffs, rms_scale=rms_scale, weight_decay=weight_decay),
       partition.ADAMW: adamw,
       partition.FROZEN: optax.set_to_zero()},
      partition.labels)


def _head_scale(per_head_first: jax.Array, per_head_rest: jax.Array, n_first: int, n_rest: int
                ) -> jax.Array:
  """[H, n_first + n_rest]: per_head_first[h] on the first n_first channels of head h, then
  per_head_rest[h]."""
  heads = per_head_first.shape[0]
  return jnp.concatenate([jnp.broadcast_to(per_head_first[:, None], (heads, n_first)),
                          jnp.broadcast_to(per_head_rest[:, None], (heads, n_rest))], axis=1)


def clip_attention(attn: dict, max_logits: jax.Array, tau: float) -> dict:
  """QK-Clip of one MLA layer's params (`self_attn`) given its per-head max logits [H].

  The channel split is read from the shapes: rope = kv_a_proj_with_mqa's width minus
  kv_lora (kv_a_layernorm's width), nope = q's head width minus rope.
  """
  gamma = jnp.where(max_logits > tau, tau / max_logits, 1.0).astype(jnp.float32)
  root = jnp.sqrt(gamma)
  rope = attn["kv_a_proj_with_mqa"]["kernel"].shape[-1] - attn["kv_a_layernorm"]["weight"].shape[0]
  q_name = "q_b_proj" if "q_b_proj" in attn else "q_proj"
  q = attn[q_name]["kernel"]                                   # [in, H, nope + rope]
  kv = attn["kv_b_proj"]["kernel"]                             # [kv_lora, H, nope + v]
  nope = q.shape[-1] - rope
  q_scale = _head_scale(root, gamma, nope, rope)
  k_scale = _head_scale(root, jnp.ones_like(gamma), nope, kv.shape[-1] - nope)
  return dict(attn, **{q_name: dict(attn[q_name], kernel=q * q_scale.astype(q.dtype)),
                       "kv_b_proj": dict(attn["kv_b_proj"], kernel=kv * k_scale.astype(kv.dtype))})


def qk_clip(params, max_logits: jax.Array, tau: float):
  """Applies QK-Clip to layers_0 … layers_{L−1}; max_logits: [L, H] (the model's aux).

  With scanned params (`moe_layers`, leaves [L−k, ...] after the k per-layer entries
  layers_0 … layers_{k−1}), rows k… of max_logits clip the stacked layers, layer by layer.
  S comes from the step's forward pass, before the update, so the next forward can exceed
  τ by one update's growth. Pure jax.numpy (unclipped heads are multiplied by exactly 1, so
  they keep their bits); works on sharded params inside a jitted step. Returns (params,
  metrics) with metrics `clipped_heads` (number of heads with S > τ), `max_logit` (the
  largest S) and `max_logit_per_layer` [L].
  """
  params = dict(params)
  per_layer = max_logits.shape[0]
  if SCANNED in params:
    stacked = params[SCANNED]
    per_layer -= jax.tree.leaves(stacked)[0].shape[0]
    clipped = jax.vmap(clip_attention, in_axes=(0, 0, None))(stacked["self_attn"], max_logits[per_layer:], tau)
    params[SCANNED] = dict(stacked, self_attn=clipped)
  for layer in range(per_layer):
    name = f"layers_{layer}"
    params[name] = dict(params[name], self_attn=clip_attention(params[name]["self_attn"],
                                                               max_logits[layer], tau))
  metrics = {"clipped_heads": jnp.sum(max_logits > tau).astype(jnp.int32),
             "max_logit": jnp.max(max_logits),
             "max_logit_per_layer": jnp.max(max_logits, axis=1)}
  return params, metrics
