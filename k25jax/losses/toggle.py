"""Toggle: alternate a length-budgeted reward with the plain one (Kimi K2.5, token-efficient RL).

    phase(t)  = (t // m) mod 2
    phase 0:  r̃(x, y) = r(x, y) · 1[ acc(x) < λ  or  |y| ≤ budget(x) ]
    phase 1:  r̃(x, y) = r(x, y)

acc(x) is the accuracy of the K sampled responses to prompt x, λ the accuracy
threshold (a prompt the policy cannot yet solve reliably is never length-penalised),
|y| the response length in tokens, budget(x) the ρ-percentile of the lengths of
correct responses to x, estimated once before RL starts (`length_budgets`).

`toggle_reward`, `toggle_phase` and `group_accuracy` are pure `jax.numpy` (jit-able);
`length_budgets` is NumPy because it fills a table once, on the host, outside jit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def toggle_phase(step, m: int):
  """phase = (step // m) mod 2: steps [0, m) are phase 0 (budgeted), [m, 2m) phase 1 (plain), ...

  step: int or int array (any shape); m: the phase length, an int >= 1.
  """
  if not isinstance(m, jax.core.Tracer) and not m >= 1:
    raise ValueError(f"toggle phase length m={m} must be >= 1")
  return (step // m) % 2


def toggle_reward(reward, length, budget, phase, group_accuracy, *, accuracy_threshold: float):
  """Toggle's reward, per sample:  r̃ = r · 1[acc < λ or |y| ≤ budget] in phase 0, r in phase 1.

  reward, length, budget, group_accuracy: [n] per sample (group_accuracy is the
  accuracy of the sample's prompt group, repeated for each of its samples, see
  `group_accuracy`; budget likewise the budget of the sample's prompt); phase: a
  scalar or [n], 0 or 1 (`toggle_phase`); accuracy_threshold: λ. Any shapes that
  broadcast together work. Returns r̃ as float32.
  """
  reward = jnp.asarray(reward, jnp.float32)
  keep = (jnp.asarray(group_accuracy) < accuracy_threshold) | (jnp.asarray(length) <= jnp.asarray(budget))
  return jnp.where(jnp.asarray(phase) == 0, jnp.where(keep, reward, 0.0), reward)


def group_accuracy(correct, group_size: int):
  """The accuracy of each prompt's group, repeated per sample: acc_j = mean_{k ∈ g(j)} correct_k.

  correct: [n_prompts * group_size] (0/1 or bool, each prompt's samples consecutive).
  Returns float32 [n_prompts * group_size], ready for `toggle_reward`.
  """
  correct = jnp.asarray(correct, jnp.float32)
  if correct.ndim != 1 or group_size < 1 or correct.shape[0] % group_size:
    raise ValueError(f"correct of shape {correct.shape} is not a flat [n_prompts * group_size={group_size}]")
  acc = jnp.mean(correct.reshape(-1, group_size), axis=-1)
  return jnp.repeat(acc, group_size)


def length_budgets(lengths, correct, prompt_ids, rho: float, fallback="global", *,
                   num_prompts: int | None = None) -> np.ndarray:
  """budget(x) = the ρ-th percentile of the lengths of the correct responses to x (NumPy, host side).

  lengths, correct, prompt_ids: [n] per sampled response (prompt_ids are ints in
  [0, num_prompts)); rho in [0, 100]. Percentiles interpolate linearly between order
  statistics (`np.percentile`'s default), so a budget may be fractional.

  A prompt with no correct response (or none sampled) gets the fallback:
    fallback="global": the ρ-th percentile over the correct responses of all prompts
        (+inf if there is none anywhere: no budget, nothing is trimmed);
    fallback=<number>: that value (e.g. float("inf") never trims such prompts).

  Returns float64 [num_prompts] (num_prompts defaults to max(prompt_ids) + 1), indexed
  by prompt id. Runs once before RL starts, outside jit: NumPy is deliberate here.
  """
  lengths = np.asarray(lengths, np.float64)
  correct = np.asarray(correct).astype(bool)
  prompt_ids = np.asarray(prompt_ids)
  if not lengths.shape == correct.shape == prompt_ids.shape or lengths.ndim != 1:
    raise ValueError(f"lengths {lengths.shape}, correct {correct.shape} and prompt_ids "
                     f"{prompt_ids.shape} must be equal flat shapes")
  if not 0.0 <= rho <= 100.0:
    raise ValueError(f"rho={rho} is a percentile in [0, 100]")
  if prompt_ids.size and (not np.issubdtype(prompt_ids.dtype, np.integer) or prompt_ids.min() < 0):
    raise ValueError("prompt_ids must be non-negative integers")
  size = int(prompt_ids.max()) + 1 if prompt_ids.size else 0
  if num_prompts is not None:
    if num_prompts < size:
      raise ValueError(f"num_prompts={num_prompts} but prompt id {size - 1} occurs")
    size = num_prompts
  if isinstance(fallback, str):
    if fallback != "global":
      raise ValueError(f"fallback={fallback!r}; use 'global' or a number")
    fallback = np.percentile(lengths[correct], rho) if correct.any() else np.inf
  budgets = np.full(size, float(fallback))
  for pid in np.unique(prompt_ids[correct]):
    budgets[pid] = np.percentile(lengths[correct & (prompt_ids == pid)], rho)
  return budgets
