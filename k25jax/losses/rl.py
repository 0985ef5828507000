"""Policy-gradient losses of the RL stage, pure `jax.numpy` (no Flax): importable by any JAX project.

The K2.5 loss (Eq. 1 of arXiv 2602.02276) and three ablation baselines share one
calling convention:

    loss, metrics = f(logp, old_logp, advantages, mask, *, <hyper-parameters>,
                      normalize="batch", group_size=None)

    logp        [B, T]  log π_θ(y_ji | x_j, y_j<i) of the sampled tokens (differentiated)
    old_logp    [B, T]  log π_old of the same tokens (the sampler's; a constant)
    advantages  [B]     one per response, broadcast over time, or [B, T] per token
    mask        [B, T]  1 on the response tokens that enter the loss, 0 on prompt/padding

Values at masked positions are never read (a NaN or ±inf there changes nothing,
neither the loss nor the gradient). Everything is computed in float32.

Normalisation (`normalize`), with n_j = Σ_i mask_ji the valid tokens of response j:

    "batch"     L = Σ_j Σ_i ℓ_ji / N,                         N = Σ_j n_j          (token mean)
    "group"     L = (1/G⁺) Σ_g  Σ_{j ∈ g} Σ_i ℓ_ji / N_g,     N_g = Σ_{j ∈ g} n_j
    "sequence"  L = (1/B⁺) Σ_j  Σ_i ℓ_ji / n_j

where the groups g are consecutive blocks of `group_size` rows (the K samples of one
prompt, as `group_advantages` expects), G⁺ counts the groups with N_g > 0 and B⁺ the
rows with n_j > 0 (an empty group or row contributes nothing and is not averaged in).
"group" is Eq. 1's 1/N: in the paper N is the token count of the K responses of ONE
prompt, so every prompt weighs the same whatever the length of its responses, and the
prompts of a batch are averaged (the RL configs' default, `loss.normalize`). "batch",
the token mean over the whole batch, weighs a prompt by the length of its responses: an
ablation, and the default of these functions for callers without groups. "sequence" is
the original GRPO per-response mean.
"""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

NORMALIZATIONS = ("batch", "group", "sequence")


def group_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
  """Group-baseline advantages of Eq. 1, no std normalisation:  A_j = r_j − mean_{k ∈ g(j)} r_k.

  rewards: flat [n_prompts * group_size] with each prompt's samples consecutive, or
  [n_prompts, group_size]. Returns float32 of the same shape. Raises ValueError when
  group_size < 2 (a single sample has no baseline) or does not tile the rewards.
  """
  r, shape = _grouped(rewards, group_size)
  return (r - jnp.mean(r, axis=-1, keepdims=True)).reshape(shape)


def grpo_advantages(rewards: jax.Array, group_size: int, *, eps: float = 1e-6) -> jax.Array:
  """GRPO's std-normalised advantages:  A_j = (r_j − mean_g r) / (std_g r + eps).

  std is the population standard deviation over the group (a group of equal rewards
  gets A = 0). Shapes and errors as `group_advantages`.
  """
  r, shape = _grouped(rewards, group_size)
  centred = r - jnp.mean(r, axis=-1, keepdims=True)
  return (centred / (jnp.std(r, axis=-1, keepdims=True) + eps)).reshape(shape)


def k25_policy_loss(logp, old_logp, advantages, mask, *, alpha: float, beta: float, tau: float,
                    normalize: str = "batch", group_size: int | None = None):
  """The Kimi K2.5 policy loss (Eq. 1), token-level clipping by masking; for one prompt
  with K responses j = 1…K and N the number of their tokens:

      L = −(1/N) Σ_j Σ_i [ M_ji · ρ_ji · A_j  −  τ · (log ρ_ji)² ]
      ρ_ji = π_θ(y_ji) / π_old(y_ji) = exp(logp − old_logp)
      M_ji = 1[α ≤ log ρ_ji ≤ β]        held constant (stop-gradient)

  and over a batch of prompts the mean of their L: `normalize="group"` with
  `group_size` = K (the paper's N; see the module docstring). `normalize="batch"`
  instead divides the whole batch's sum by its token count N (an ablation).
  Tokens outside the band [α, β] get no policy gradient whatever the sign of A_j;
  the τ term applies to every valid token, so its gradient, ∂L/∂logp_ji =
  2τ · log ρ_ji / N, is all that is left there. At θ = θ_old (ρ = 1) the gradient is
  −A_j · mask_ji / N (with "group", N = N_g times the number of non-empty groups).
  Shapes: logp, old_logp, mask [B, T]; advantages [B] or [B, T].

  Requires α < 0 < β and τ ≥ 0 (ValueError otherwise; checked when the values are
  concrete, i.e. not traced). Returns (L, metrics):
    masked_above / masked_below / masked_fraction: fraction of valid tokens with
        log ρ > β / log ρ < α / either;
    log_ratio_mean, log_ratio_sq_mean, ratio_max, kl_k3: token means over valid tokens
        (kl_k3 = ρ − 1 − log ρ, Schulman's k3 estimate of KL(π_old ‖ π_θ));
    policy_loss, tau_loss: the two parts of L (L = policy_loss + tau_loss);
    tokens: the valid tokens of the batch.
  """
  _check_k25_hparams(alpha, beta, tau)
  logp, old_logp, adv, mask = _prepare(logp, old_logp, advantages, mask)
  weights = _token_weights(mask, normalize, group_size)
  log_ratio = _log_ratio(logp, old_logp, mask)
  below = log_ratio < alpha
  above = log_ratio > beta
  in_band = jax.lax.stop_gradient(jnp.logical_not(below | above))
  # exp only inside the band: an overflowing ρ outside it must not turn 0·∞ into NaN.
  ratio = jnp.exp(jnp.where(in_band, log_ratio, 0.0))
  policy_term = jnp.where(in_band, ratio * adv, 0.0)
  policy_loss = -jnp.sum(weights * policy_term)
  tau_loss = tau * jnp.sum(weights * jnp.square(log_ratio))
  valid = mask > 0
  metrics = {
      "masked_above": _token_mean(above & valid, mask),
      "masked_below": _token_mean(below & valid, mask),
      "masked_fraction": _token_mean((above | below) & valid, mask),
      "policy_loss": policy_loss,
      "tau_loss": tau_loss,
      **_ratio_metrics(log_ratio, mask),
  }
  return policy_loss + tau_loss, metrics


def ppo_clip_loss(logp, old_logp, advantages, mask, *, eps: float = 0.2, eps_high: float | None = None,
                  normalize: str = "batch", group_size: int | None = None):
  """PPO's clipped surrogate at the token level (no value model, no entropy bonus):

      L = −(1/N) Σ_j Σ_i min( ρ_ji A_ji ,  clip(ρ_ji, 1 − ε, 1 + ε_high) A_ji )

  ε_high defaults to ε (symmetric PPO); ε_high > ε is DAPO's "clip-higher". A token
  whose clipped branch is the minimum has zero gradient. Shapes as `k25_policy_loss`.
  Returns (L, metrics) with clip_fraction (fraction of valid tokens whose gradient is
  clipped away), the ratio metrics of `k25_policy_loss`, and tokens.
  """
  eps_high = eps if eps_high is None else eps_high
  _check_positive(eps=eps, eps_high=eps_high)
  logp, old_logp, adv, mask = _prepare(logp, old_logp, advantages, mask)
  weights = _token_weights(mask, normalize, group_size)
  log_ratio = _log_ratio(logp, old_logp, mask)
  surrogate, clipped = _clipped_surrogate(log_ratio, adv, 1.0 - eps, 1.0 + eps_high)
  metrics = {"clip_fraction": _token_mean(clipped & (mask > 0), mask),
             **_ratio_metrics(log_ratio, mask)}
  return -jnp.sum(weights * surrogate), metrics


def grpo_loss(logp, old_logp, rewards, mask, *, group_size: int, eps: float = 0.2,
              kl_coef: float = 0.0, ref_logp=None, std_eps: float = 1e-6,
              normalize: str = "sequence"):
  """GRPO (DeepSeekMath): std-normalised group advantages, PPO clipping, optional KL to a reference:

      Â_j  = (r_j − mean_g r) / (std_g r + std_eps)           (see `grpo_advantages`)
      L    = −(1/B) Σ_j (1/n_j) Σ_i [ min(ρ_ji Â_j, clip(ρ_ji, 1−ε, 1+ε) Â_j) − β_KL · D_ji ]
      D_ji = π_ref/π_θ − log(π_ref/π_θ) − 1                    (the k3 estimator, ≥ 0)

  `normalize` defaults to "sequence", the per-response mean of the paper; "batch" and
  "group" are as in the module docstring. rewards: [B] with each prompt's
  `group_size` samples consecutive. ref_logp [B, T] is required when kl_coef > 0.
  Returns (L, metrics): clip_fraction, kl_ref (token mean of D; 0 without a
  reference), the ratio metrics of `k25_policy_loss`, tokens.
  """
  _check_positive(eps=eps)
  if kl_coef < 0:
    raise ValueError(f"kl_coef={kl_coef} must be >= 0")
  if kl_coef > 0 and ref_logp is None:
    raise ValueError("kl_coef > 0 needs ref_logp, the reference policy's log-probs [B, T]")
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 1:
    raise ValueError(f"grpo_loss rewards must be [B] (one per response), got shape {rewards.shape}")
  adv = grpo_advantages(rewards, group_size, eps=std_eps)
  logp, old_logp, adv, mask = _prepare(logp, old_logp, adv, mask)
  weights = _token_weights(mask, normalize, group_size)
  log_ratio = _log_ratio(logp, old_logp, mask)
  surrogate, clipped = _clipped_surrogate(log_ratio, adv, 1.0 - eps, 1.0 + eps)
  loss = -jnp.sum(weights * surrogate)
  kl = jnp.zeros_like(logp)
  if ref_logp is not None:
    ref_logp = jnp.asarray(ref_logp, jnp.float32)
    if ref_logp.shape != logp.shape:
      raise ValueError(f"ref_logp shape {ref_logp.shape} != logp shape {logp.shape}")
    log_ref_ratio = jnp.where(mask > 0, jax.lax.stop_gradient(ref_logp) - logp, 0.0)
    kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0
    loss = loss + kl_coef * jnp.sum(weights * kl)
  metrics = {"clip_fraction": _token_mean(clipped & (mask > 0), mask),
             "kl_ref": jnp.sum(mask * kl) / _num_tokens(mask),
             **_ratio_metrics(log_ratio, mask)}
  return loss, metrics


def cispo_loss(logp, old_logp, advantages, mask, *, eps_high: float, eps_low: float | None = None,
               normalize: str = "batch", group_size: int | None = None):
  """CISPO (MiniMax-M1): clip the importance-sampling weight, not the update; every token keeps a gradient:

      L   = −(1/N) Σ_j Σ_i sg(r̂_ji) · A_ji · log π_θ(y_ji)
      r̂_ji = clip(ρ_ji, 1 − ε_low, 1 + ε_high),   sg = stop-gradient

  so ∂L/∂logp_ji = −r̂_ji A_ji / N. ε_low = None means no lower bound (MiniMax-M1 sets
  ε_low large and tunes only ε_high). The loss value is not a surrogate of the return;
  only its gradient is meaningful. Shapes as `k25_policy_loss`. Returns (L, metrics)
  with clip_fraction (valid tokens whose weight was clipped), the ratio metrics, tokens.
  """
  _check_positive(eps_high=eps_high)
  if eps_low is not None:
    _check_positive(eps_low=eps_low)
  logp, old_logp, adv, mask = _prepare(logp, old_logp, advantages, mask)
  weights = _token_weights(mask, normalize, group_size)
  log_ratio = _log_ratio(logp, old_logp, mask)
  ratio = jnp.exp(jax.lax.stop_gradient(log_ratio))
  low = 0.0 if eps_low is None else 1.0 - eps_low
  is_weight = jnp.clip(ratio, low, 1.0 + eps_high)
  clipped = (ratio > 1.0 + eps_high) | (ratio < low)
  safe_logp = jnp.where(mask > 0, logp, 0.0)
  metrics = {"clip_fraction": _token_mean(clipped & (mask > 0), mask),
             **_ratio_metrics(log_ratio, mask)}
  return -jnp.sum(weights * is_weight * adv * safe_logp), metrics


# --- shared pieces -----------------------------------------------------------------


def _grouped(rewards, group_size: int):
  """rewards [n*G] or [n, G] -> ([n, G] float32, original shape), with the errors of group_advantages."""
  rewards = jnp.asarray(rewards, jnp.float32)
  if not _is_int(group_size) or group_size < 2:
    raise ValueError(f"group_size={group_size!r} must be an int >= 2 (a group needs a baseline)")
  if rewards.ndim == 1:
    if rewards.shape[0] % group_size:
      raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
  elif rewards.ndim == 2:
    if rewards.shape[1] != group_size:
      raise ValueError(f"rewards of shape {rewards.shape} are not [n_prompts, group_size={group_size}]")
  else:
    raise ValueError(f"rewards must be [n*group_size] or [n, group_size], got shape {rewards.shape}")
  return rewards.reshape(-1, group_size), rewards.shape


def _prepare(logp, old_logp, advantages, mask):
  """Casts to float32, checks shapes, broadcasts [B] advantages to [B, T], stops gradients of constants."""
  logp = jnp.asarray(logp, jnp.float32)
  old_logp = jax.lax.stop_gradient(jnp.asarray(old_logp, jnp.float32))
  mask = jax.lax.stop_gradient(jnp.asarray(mask, jnp.float32))
  adv = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
  if logp.ndim != 2:
    raise ValueError(f"logp must be [batch, time], got shape {logp.shape}")
  if old_logp.shape != logp.shape or mask.shape != logp.shape:
    raise ValueError(f"logp {logp.shape}, old_logp {old_logp.shape} and mask {mask.shape} must match")
  if adv.shape == logp.shape[:1]:
    adv = jnp.broadcast_to(adv[:, None], logp.shape)
  elif adv.shape != logp.shape:
    raise ValueError(f"advantages must be [batch]={logp.shape[:1]} or [batch, time]={logp.shape}, "
                     f"got {adv.shape}")
  adv = jnp.where(mask > 0, adv, 0.0)
  return logp, old_logp, adv, mask


def _token_weights(mask, normalize: str, group_size: int | None):
  """w [B, T] with L = Σ w · ℓ for the normalisations of the module docstring."""
  if normalize == "batch":
    return mask / _num_tokens(mask)
  if normalize == "sequence":
    per_row = jnp.sum(mask, axis=-1, keepdims=True)
    rows = jnp.sum(per_row > 0)
    return mask / jnp.maximum(per_row, 1.0) / jnp.maximum(rows, 1)
  if normalize == "group":
    batch = mask.shape[0]
    if not _is_int(group_size) or group_size < 1 or batch % group_size:
      raise ValueError(f"normalize='group' needs group_size, an int dividing the batch ({batch}); "
                       f"got group_size={group_size!r}")
    per_group = jnp.sum(mask.reshape(batch // group_size, -1), axis=-1)
    groups = jnp.sum(per_group > 0)
    w_group = 1.0 / jnp.maximum(per_group, 1.0) / jnp.maximum(groups, 1)
    return mask * jnp.repeat(w_group, group_size)[:, None]
  raise ValueError(f"normalize={normalize!r}; choose one of {NORMALIZATIONS}")


def _log_ratio(logp, old_logp, mask):
  """log ρ = logp − old_logp on valid tokens, 0 elsewhere (garbage in padding never leaks)."""
  return jnp.where(mask > 0, logp - old_logp, 0.0)


def _clipped_surrogate(log_ratio, adv, low: float, high: float):
  """min(ρA, clip(ρ, low, high)A) and where the clipped branch is the strict minimum (zero gradient)."""
  ratio = jnp.exp(log_ratio)
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, low, high) * adv
  return jnp.minimum(unclipped, clipped), clipped < unclipped


def _is_int(x) -> bool:
  try:
    return operator.index(x) == x and not isinstance(x, bool)
  except TypeError:
    return False


def _num_tokens(mask):
  return jnp.maximum(jnp.sum(mask), 1.0)


def _token_mean(flags, mask):
  return jnp.sum(jnp.where(mask > 0, flags.astype(jnp.float32), 0.0)) / _num_tokens(mask)


def _ratio_metrics(log_ratio, mask):
  lr = jax.lax.stop_gradient(log_ratio)
  n = _num_tokens(mask)
  return {
      "log_ratio_mean": jnp.sum(mask * lr) / n,
      "log_ratio_sq_mean": jnp.sum(mask * jnp.square(lr)) / n,
      "ratio_max": jnp.max(jnp.where(mask > 0, jnp.exp(lr), 0.0)),
      "kl_k3": jnp.sum(mask * (jnp.exp(lr) - 1.0 - lr)) / n,
      "tokens": jnp.sum(mask),
  }


def _concrete(x):
  """float(x) if x is a concrete number, None if it is traced under jit."""
  if isinstance(x, jax.core.Tracer):
    return None
  return float(x)


def _check_k25_hparams(alpha, beta, tau):
  a, b, t = _concrete(alpha), _concrete(beta), _concrete(tau)
  if a is not None and b is not None and not a < 0.0 < b:
    raise ValueError(f"k25_policy_loss needs alpha < 0 < beta (a band around log ρ = 0); "
                     f"got alpha={a}, beta={b}")
  if t is not None and not t >= 0.0:
    raise ValueError(f"k25_policy_loss needs tau >= 0, got tau={t}")


def _check_positive(**values):
  for name, value in values.items():
    v = _concrete(value)
    if v is not None and not v > 0.0:
      raise ValueError(f"{name}={v} must be > 0")
