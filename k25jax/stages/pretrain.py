"""Pre-training: next-token prediction on packed documents, text-only or joint vision–text.

Per step, with packed rows (segment_ids, positions) and loss mask w:

    L = CE(θ) + z · mean_t (log Z_t)² + α · L_balance          (objective.next_token)
    θ ← AdamW or MuonClip(θ, ∇L)   (router biases excluded),   b_l ← b_l + γ · sign(mean(load_l) − load_l)

Text-only (`configs/pretrain.py`): the K2 decoder on the text source; evaluation is the
held-out text loss. Joint (`configs/pretrain.py:joint`, a `model` section with `vision`):
the K2.5 model on rows mixing text with synthetic vision samples (`k25jax.train.joint`).
"""
from __future__ import annotations

import jax
import ml_collections
from absl import logging

from k25jax.data import files, pipeline, sources, tokenizer
from k25jax.model import transformer
from k25jax.train import config_utils, joint, loop, objective, optimizer, sharding, trainer as trainer_lib


def datasets(config: ml_collections.ConfigDict, tok):
  """(train iterator of this process's rows, fixed list of eval batches); with
  `data.source=files`, the token-weighted mixture of the files' sources (`data/files.py`)."""
  n_proc = jax.process_count()
  kw = dict(seq_len=config.train.seq_len, batch=config.train.batch // n_proc, seed=config.train.seed,
            shard_index=jax.process_index(), shard_count=n_proc)
  if config.data.source == "files":
    mixed, eval_docs = files.load(config.data, tok)
    kw["max_doc_tokens"] = files.max_doc_tokens([d for _, docs in mixed if isinstance(docs, list) for d in docs]
                                                + eval_docs)
    train = iter(files.mixture(mixed, tok, **kw))
  else:
    train_docs, eval_docs = sources.text_documents(config.data)
    kw["max_doc_tokens"] = 4 * config.data.max_doc_chars + 2
    train = iter(pipeline.lm_dataset(train_docs, tok, **kw))
  evals = pipeline.take(pipeline.lm_dataset(eval_docs, tok, shuffle=False, **kw), config.train.eval_batches)
  return train, evals


def make_step(config: ml_collections.ConfigDict, model: transformer.Transformer, tx):
  """The jitted train step (state, batch) -> (state, metrics) of text pre-training; call under `jax.set_mesh`."""
  return trainer_lib.train_step(model, tx, objective.for_section(model, config.train), router_bias_rate=config.train.router_bias_rate,
                                qk_clip_tau=optimizer.qk_clip_tau(config.optimizer))


def check(config: ml_collections.ConfigDict) -> None:
  """The stage's config check (before anything is built): the schedule fits the run, the
  data source exists."""
  trainer_lib.check(config)
  sources.check(config.data)


def run(config: ml_collections.ConfigDict, workdir: str):
  """Trains to `config.train.steps`, resuming from the workdir's latest checkpoint.
  Returns (state, history) with history the logged metrics (see `loop.train`)."""
  check(config)
  joint_run = "vision" in config.model
  tok = tokenizer.load(config.data.tokenizer, config.data.vocab_file, media=joint_run)
  if joint_run:
    return joint.run(config, workdir, config_utils.k25_config_from(config.model, tok), tok)
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  trainer_lib.check_rows(config, tok, model, mesh)
  train_data, eval_data = datasets(config, tok)
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  to_device = lambda rows: sharding.global_batch(rows, sharding.batch_sharding(mesh))
  with trainer_lib.Trainer.for_config(config, workdir, model, tx, mesh) as trainer:
    state = trainer.start(config.init, train_data)
    logging.info("pretrain: %s, mesh %s, starting at step %d", model.cfg.to_json().replace("\n", ""),
                 dict(mesh.shape), int(state.step))
    eval_step = trainer.eval_step(objective.for_section(model, config.train))
    eval_batches = [to_device(b) for b in eval_data]
    return trainer.fit(state, make_step(config, model, tx), lambda _: to_device(next(train_data)), config.train,
                       tokens_per_step=config.train.batch * config.train.seq_len,
                       evaluate=lambda s: loop.evaluate(eval_step, s, eval_batches), data_iterator=train_data)
