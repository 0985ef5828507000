"""Supervised fine-tuning on a fixed set of token sequences (the warm starts of RL and PARL).

The sequences are first packed (best fit, longest first) into rows of the padded
length: each row holds several sequences as segments 1..k, positions restarting at 0,
so short contexts do not pay for padding. Per step, packed rows r drawn without
replacement from a generator seeded by (seed, step):

    L = Σ_t w_{r,t+1} · CE(model(x_r)_t, x_{r,t+1}) / Σ_t w_{r,t+1}     (losses.next_token_loss)

w is the loss mask of the sequences (1 on the tokens the model must learn to write).
Batches depend only on the step, so a resumed run sees exactly the same data.
"""
from __future__ import annotations

import jax
import ml_collections
import numpy as np
from absl import logging

from k25jax import losses
from k25jax.model import transformer
from k25jax.train import checkpoint, loop, optimizer, sharding, state as state_lib, step as step_lib


def pack(tokens: np.ndarray, weights: np.ndarray, lengths: np.ndarray, share_rows: bool = True
         ) -> dict[str, np.ndarray]:
  """Right-padded sequences [n, L] → packed next-token rows [rows, L − 1].

  Sequence i contributes inputs x_i[:-1], targets x_i[1:] and weights w_i[1:]
  (lengths[i] − 1 positions); rows get inputs, targets, loss_mask, positions and
  segment_ids (1..k, 0 = padding). With share_rows=False every sequence gets a row.
  """
  width = tokens.shape[1] - 1
  rows: list[list[int]] = []
  by_room: list[list[int]] = [[] for _ in range(width + 1)]   # rows by their free positions
  for i in sorted(range(len(tokens)), key=lambda i: (-int(lengths[i]), i)):
    need = int(lengths[i]) - 1
    fits = next((f for f in range(need, width + 1) if by_room[f]), None) if share_rows else None
    if fits is None:                       # best fit: the row with the least room that suffices
      rows.append([i])
      by_room[width - need].append(len(rows) - 1)
    else:
      r = by_room[fits].pop()
      rows[r].append(i)
      by_room[fits - need].append(r)
  out = {name: np.zeros((len(rows), width), dtype) for name, dtype in (
      ("inputs", np.int32), ("targets", np.int32), ("loss_mask", np.float32), ("positions", np.int32),
      ("segment_ids", np.int32))}
  for r, members in enumerate(rows):
    at = 0
    for segment, i in enumerate(members, start=1):
      n = int(lengths[i]) - 1
      out["inputs"][r, at:at + n] = tokens[i, :n]
      out["targets"][r, at:at + n] = tokens[i, 1:n + 1]
      out["loss_mask"][r, at:at + n] = weights[i, 1:n + 1]
      out["positions"][r, at:at + n] = np.arange(n)
      out["segment_ids"][r, at:at + n] = segment
      at += n
  return out


def loss_fn_for(model: transformer.Transformer, z_loss: float = 0.0):
  def loss_fn(params, batch, rng):
    del rng
    logits, aux = model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"])
    loss, metrics = losses.next_token_loss(logits, batch["targets"], batch["loss_mask"], z_loss=z_loss)
    return loss, (metrics, aux)
  return loss_fn


def train(config: ml_collections.ConfigDict, model: transformer.Transformer, tokens: np.ndarray,
          weights: np.ndarray, lengths: np.ndarray, *, mesh, workdir: str, init_params=None):
  """Trains `config.steps` steps of `config.batch` rows; resumes from `workdir`'s checkpoints.

  config: steps, batch, seed, pack (share rows between sequences), log_every,
  checkpoint_every, router_bias_rate and an `optimizer` section (k25jax.train.optimizer).
  Returns (params, history).
  """
  tx = optimizer.make_optimizer(config.optimizer, config.steps)
  abstract = state_lib.abstract(transformer.abstract_params(model.cfg), tx)
  shardings = sharding.logical_to_sharding(abstract, mesh)
  param_rng, state_rng = jax.random.split(jax.random.PRNGKey(config.seed))
  fresh = init_params if init_params is not None else transformer.init_params(model.cfg, param_rng)
  create = jax.jit(lambda p: state_lib.create(p, tx, state_rng), out_shardings=shardings)
  target = checkpoint.abstract_target(jax.eval_shape(create, fresh), shardings)
  checkpoints = checkpoint.Checkpoints(workdir, keep=2)
  writer = loop.MetricWriter(workdir)
  to_device = lambda rows: sharding.global_batch(rows, sharding.batch_sharding(mesh))
  packed = pack(tokens, weights, lengths, share_rows=config.pack)
  n_rows = len(packed["inputs"])
  if config.batch > n_rows:
    raise ValueError(f"sft batch={config.batch} exceeds the {n_rows} packed rows of {len(tokens)} demonstrations")
  train_step = step_lib.make_train_step(loss_fn_for(model), tx, abstract, router_gamma=config.router_bias_rate,
                                        first_moe_layer=model.cfg.first_k_dense_replace)
  with jax.set_mesh(mesh):
    state = checkpoints.restore_latest(target)
    if state is None:
      state = create(fresh)
    counter = [int(state.step)]
    logging.info("sft: %d demonstrations packed into %d rows, %d steps of %d rows, from step %d in %s",
                 len(tokens), n_rows, config.steps, config.batch, counter[0], workdir)

    def next_batch():
      rows = np.sort(np.random.default_rng([config.seed, counter[0]]).choice(n_rows, config.batch, replace=False))
      counter[0] += 1
      return to_device({name: v[rows] for name, v in packed.items()})

    state, history = loop.train(
        state, train_step=train_step, next_batch=next_batch, total_steps=config.steps,
        tokens_per_step=config.batch * (tokens.shape[1] - 1), log_every=config.log_every,
        eval_every=config.steps, checkpoint_every=config.checkpoint_every,
        evaluate_fn=None, save_fn=lambda n, s: checkpoints.save(n, s), writer=writer)
  checkpoints.close()
  writer.close()
  return state.params, history
