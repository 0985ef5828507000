"""Toggle in an RL run (Kimi K2.5): budgets estimated once, rewards gated in phase 0.

    phase(i)   = (i // m) % 2                                       (toggle.m iterations a phase)
    budget(x)  = ρ-percentile of the lengths of the starting policy's correct responses to x
                 (toggle.budget_samples per prompt, estimated once, kept in the workdir)
    r_j       ← r_j · 1[acc(x) < λ  or  |y_j| ≤ budget(x)]   in phase 0; r_j in phase 1

The stages say how they sample and measure a response (`estimate` below); the math is
`k25jax.losses` (toggle_phase, group_accuracy, toggle_reward, length_budgets). The
`toggle` section: enabled, m, rho, accuracy_threshold, budget_samples.
"""
from __future__ import annotations

import os
from typing import Callable

import jax
import numpy as np

from k25jax import losses
from k25jax.train import checkpoint

BUDGETS_FILE = "toggle_budgets.npy"


def budgets(section, lengths, correct, prompt_rows, num_prompts: int) -> np.ndarray:
  """budget(x) for prompts 0..num_prompts-1 from sampled responses (their prompt rows)."""
  return np.asarray(losses.length_budgets(np.asarray(lengths), np.asarray(correct), np.asarray(prompt_rows),
                                          section.rho, num_prompts=num_prompts), np.float32)


def fixed_budgets(workdir: str, estimate: Callable[[], np.ndarray]) -> np.ndarray:
  """The run's budgets: `estimate()` on its first start (saved by process 0), read back on a resume."""
  path = os.path.join(workdir, BUDGETS_FILE)
  if os.path.exists(path):
    return np.load(path)
  out = estimate()
  if jax.process_index() == 0:
    checkpoint.write_atomically(path, lambda f: np.save(f, out))
  return out


def shape_rewards(section, group_size: int, iteration: int, reward, correct, length, budget) -> tuple[np.ndarray, int]:
  """Toggle's gated rewards in phase 0, the plain ones otherwise (and without Toggle, phase -1).

  reward, correct, length, budget: [n] per response, each prompt's group_size consecutive."""
  if not section.enabled:
    return np.asarray(reward, np.float32), -1
  phase = int(losses.toggle_phase(iteration, section.m))
  acc = np.asarray(losses.group_accuracy(np.asarray(correct), group_size))
  gated = losses.toggle_reward(np.asarray(reward), np.asarray(length), np.asarray(budget), phase, acc,
                               accuracy_threshold=section.accuracy_threshold)
  return np.asarray(gated, np.float32), phase
