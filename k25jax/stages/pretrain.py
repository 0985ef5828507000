"""Text-only pre-training of the K2 decoder: next-token prediction on packed documents.

Per step, with packed rows (segment_ids, positions) and loss mask w:

    L = CE(θ) + z · mean_t (log Z_t)² + α · L_balance          (k25jax.losses.next_token_loss)
    θ ← AdamW or MuonClip(θ, ∇L)   (router biases excluded),   b_l ← b_l + γ · sign(mean(load_l) − load_l)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging

from k25jax import losses
from k25jax.data import pipeline, sources, tokenizer
from k25jax.model import transformer
from k25jax.train import checkpoint, config_utils, loop, optimizer, sharding, state as state_lib, step


def make_loss(config: ml_collections.ConfigDict, model: transformer.Transformer):
  """loss_fn(params, batch, rng) -> (L, (metrics, aux)), the equation above."""

  def loss_fn(params, batch, rng):
    del rng  # deterministic forward pass
    logits, aux = model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"])
    loss, metrics = losses.next_token_loss(logits, batch["targets"], batch["loss_mask"],
                                           z_loss=config.train.z_loss)
    loss = loss + config.train.balance_loss_alpha * aux["balance_loss"]
    load = aux["expert_load"]
    metrics = dict(metrics, balance_loss=aux["balance_loss"], max_attention_logit=jnp.max(aux["max_logits"]),
                   expert_load_max_over_mean=jnp.max(load / jnp.maximum(load.mean(-1, keepdims=True), 1.0))
                   if load.shape[0] else jnp.zeros(()))
    return loss, (metrics, aux)

  return loss_fn


def make_step(config: ml_collections.ConfigDict, model: transformer.Transformer, tx):
  """The jitted train step (state, batch) -> (state, metrics); call under `jax.set_mesh`."""
  abstract = state_lib.abstract(transformer.abstract_params(model.cfg), tx)
  return step.make_train_step(make_loss(config, model), tx, abstract,
                              router_gamma=config.train.router_bias_rate,
                              first_moe_layer=model.cfg.first_k_dense_replace,
                              qk_clip_tau=optimizer.qk_clip_tau(config.optimizer))


def make_eval_step(config: ml_collections.ConfigDict, model: transformer.Transformer, tx):
  abstract = state_lib.abstract(transformer.abstract_params(model.cfg), tx)
  return step.make_eval_step(make_loss(config, model), abstract)


def init_state(config, model: transformer.Transformer, tx, mesh):
  """Returns (create, target): `create()` makes a fresh state directly with its shardings
  (no full copy on one device); `target` is its shape and shardings, to restore into."""
  abstract = state_lib.abstract(transformer.abstract_params(model.cfg), tx)
  shardings = sharding.logical_to_sharding(abstract, mesh)
  param_rng, state_rng = jax.random.split(jax.random.PRNGKey(config.train.seed))
  create = jax.jit(lambda: state_lib.create(transformer.init_params(model.cfg, param_rng), tx, state_rng),
                   out_shardings=shardings)
  return create, checkpoint.abstract_target(jax.eval_shape(create), shardings)


def datasets(config, tok):
  """(train iterator of this process's rows, fixed list of eval batches)."""
  train_docs, eval_docs = sources.split(sources.load(config.data.source, config.data.max_doc_chars),
                                        config.data.eval_every)
  n_proc = jax.process_count()
  kw = dict(seq_len=config.train.seq_len, batch=config.train.batch // n_proc, seed=config.train.seed,
            max_doc_tokens=4 * config.data.max_doc_chars + 2, shard_index=jax.process_index(),
            shard_count=n_proc)
  train = iter(pipeline.lm_dataset(train_docs, tok, **kw))
  evals = pipeline.take(pipeline.lm_dataset(eval_docs, tok, shuffle=False, **kw), config.train.eval_batches)
  return train, evals


def check(config, model_cfg, tok, mesh) -> None:
  """Config errors that only show once the pieces meet, each naming its field."""
  if tok.vocab_size > model_cfg.vocab_size:
    raise ValueError(f"data.tokenizer has {tok.vocab_size} ids but model.vocab_size={model_cfg.vocab_size}")
  shards = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
  for divisor, what in ((shards, "the mesh's data x fsdp x expert devices"), (jax.process_count(), "processes")):
    if config.train.batch % divisor:
      raise ValueError(f"train.batch={config.train.batch} must divide evenly over {divisor} {what}")
  if config.train.seq_len % mesh.shape["sequence"]:
    raise ValueError(f"train.seq_len={config.train.seq_len} must divide over mesh.sequence={mesh.shape['sequence']}")


def run(config: ml_collections.ConfigDict, workdir: str):
  """Trains to `config.train.steps`, resuming from the workdir's latest checkpoint.
  Returns (state, history) with history the logged metrics (see `loop.train`)."""
  model_cfg = config_utils.model_config_from(config.model)
  tok = tokenizer.load(config.data.tokenizer, config.data.vocab_file)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  check(config, model_cfg, tok, mesh)
  checkpoints = checkpoint.Checkpoints(workdir, keep=config.train.keep_checkpoints)
  writer = loop.MetricWriter(workdir)
  train_data, eval_data = datasets(config, tok)
  model = transformer.Transformer(model_cfg)
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  batch_sharding = sharding.batch_sharding(mesh)
  to_device = lambda rows: sharding.global_batch(rows, batch_sharding)

  with jax.set_mesh(mesh):
    create, target = init_state(config, model, tx, mesh)
    state = checkpoints.restore_latest(target, train_data)
    if state is None:
      state = create()
    logging.info("pretrain: %s, mesh %s, starting at step %d", model_cfg.to_json().replace("\n", ""),
                 dict(mesh.shape), int(state.step))
    train_step = make_step(config, model, tx)
    eval_step = make_eval_step(config, model, tx)
    eval_batches = [to_device(b) for b in eval_data]
    state, history = loop.train(
        state, train_step=train_step, next_batch=lambda: to_device(next(train_data)),
        total_steps=config.train.steps, tokens_per_step=config.train.batch * config.train.seq_len,
        log_every=config.train.log_every, eval_every=config.train.eval_every,
        checkpoint_every=config.train.checkpoint_every,
        evaluate_fn=lambda s: loop.evaluate(eval_step, s, eval_batches),
        save_fn=lambda n, s: checkpoints.save(n, s, train_data), writer=writer)
  checkpoints.close()
  writer.close()
  return state, history
