"""Supervised fine-tuning on a fixed set of token sequences (the warm starts of RL and PARL).

Per step, rows r drawn without replacement from a generator seeded by (seed, step):

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


def batch_rows(tokens: np.ndarray, weights: np.ndarray, lengths: np.ndarray, rows: np.ndarray) -> dict:
  """Right-padded sequences → model inputs: inputs/targets shifted by one, padding as segment 0."""
  x = tokens[rows]
  seq = x.shape[1] - 1
  positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (len(rows), seq))
  return {"inputs": x[:, :-1].astype(np.int32), "targets": x[:, 1:].astype(np.int32),
          "loss_mask": weights[rows, 1:].astype(np.float32), "positions": positions,
          "segment_ids": (positions < lengths[rows, None]).astype(np.int32)}


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

  config: steps, batch, seed, log_every, checkpoint_every, router_bias_rate and an
  `optimizer` section (k25jax.train.optimizer). Returns (params, history).
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
  if config.batch > len(tokens):
    raise ValueError(f"sft batch={config.batch} exceeds the {len(tokens)} demonstrations")
  train_step = step_lib.make_train_step(loss_fn_for(model), tx, abstract, router_gamma=config.router_bias_rate,
                                        first_moe_layer=model.cfg.first_k_dense_replace)
  with jax.set_mesh(mesh):
    state = checkpoints.restore_latest(target)
    if state is None:
      state = create(fresh)
    counter = [int(state.step)]
    logging.info("sft: %d demonstrations, %d steps of %d rows, from step %d in %s", len(tokens), config.steps,
                 config.batch, counter[0], workdir)

    def next_batch():
      rows = np.random.default_rng([config.seed, counter[0]]).choice(len(tokens), config.batch, replace=False)
      counter[0] += 1
      return to_device(batch_rows(tokens, weights, lengths, np.sort(rows)))

    state, history = loop.train(
        state, train_step=train_step, next_batch=next_batch, total_steps=config.steps,
        tokens_per_step=config.batch * (tokens.shape[1] - 1), log_every=config.log_every,
        eval_every=config.steps, checkpoint_every=config.checkpoint_every,
        evaluate_fn=None, save_fn=lambda n, s: checkpoints.save(n, s), writer=writer)
  checkpoints.close()
  writer.close()
  return state.params, history
