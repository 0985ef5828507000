"""The built-in warm start of the RL stages (rl, parl): a fresh model fine-tuned on a task's
demonstrations, resumable, in its own workdir (`<run>/warm_start`).

Per step, `warm_start.batch` packed rows r of the demonstrations (`k25jax.data.packing`,
drawn by (warm_start.seed, step)):

    L = Σ_t w_{r,t+1} · CE(model(x_r)_t, x_{r,t+1}) / Σ_t w_{r,t+1}      (objective.next_token)

w is the demonstrations' loss mask (1 on the tokens the model must learn to write). The
`warm_start` section: steps, batch, seed, pack (share rows between demonstrations),
log_every, checkpoint_every, router_bias_rate and an `optimizer` section.
"""
from __future__ import annotations

import jax
import ml_collections
import numpy as np
from absl import logging

from k25jax.data import packing
from k25jax.train import objective, optimizer, sharding, trainer as trainer_lib


def check(section: ml_collections.ConfigDict) -> None:
  """The config check of the `warm_start` section's length: its schedule fits `warm_start.steps`."""
  optimizer.check_schedule(section.optimizer, section.steps, section="warm_start.optimizer",
                           length="warm_start.steps")


def train(section: ml_collections.ConfigDict, model, tokens: np.ndarray, weights: np.ndarray, lengths: np.ndarray,
          *, mesh: jax.sharding.Mesh, workdir: str, init_params=None):
  """Trains (or resumes) `section.steps` steps in `workdir`, from `init_params` (default a
  fresh init). Returns (params, history)."""
  packed = packing.pack(tokens, weights, lengths, share_rows=section.pack)
  n_rows = len(packed["inputs"])
  if section.batch > n_rows:
    raise ValueError(f"warm_start.batch={section.batch} exceeds the {n_rows} packed rows of {len(tokens)} "
                     "demonstrations")
  to_device = lambda rows: sharding.from_host(rows, sharding.batch_sharding(mesh))   # every process draws all rows
  rows_at = lambda step: packing.draw_rows(packing.step_rng(section.seed, step), n_rows, section.batch)
  batch_at = lambda step: to_device({name: v[rows_at(step)] for name, v in packed.items()})
  tx = optimizer.make_optimizer(section.optimizer, section.steps)
  with trainer_lib.Trainer(workdir, model, tx, mesh=mesh, seed=section.seed, keep_checkpoints=2) as trainer:
    state = trainer.start(default_params=None if init_params is None else lambda: init_params)
    logging.info("warm start: %d demonstrations packed into %d rows, %d steps of %d rows, from step %d in %s",
                 len(tokens), n_rows, section.steps, section.batch, int(state.step), workdir)
    step = trainer.train_step(objective.next_token(model), router_bias_rate=section.router_bias_rate,
                              qk_clip_tau=optimizer.qk_clip_tau(section.optimizer))
    state, history = trainer.fit(state, step, batch_at, section, tokens_per_step=section.batch * (tokens.shape[1] - 1))
  return state.params, history
