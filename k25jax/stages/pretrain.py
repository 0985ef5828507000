"""Pre-training: next-token prediction on packed documents, text-only or joint vision–text.

Per step, with packed rows (segment_ids, positions) and loss mask w:

    L = CE(θ) + z · mean_t (log Z_t)² + α · L_balance          (k25jax.losses.next_token_loss)
    θ ← AdamW or MuonClip(θ, ∇L)   (router biases excluded),   b_l ← b_l + γ · sign(mean(load_l) − load_l)

Text-only (`configs/pretrain.py`): the K2 decoder on the text source. Joint
(`configs/pretrain.py:joint`, a `model` section with `vision`): the K2.5 model on rows
that mix text with synthetic vision samples, the vision share by tokens following
`data.vision_ratio` / `vision_schedule` / `vision_start` (k25jax.data.mixture: constant
from step 0 is early fusion, a late start late fusion); every part of the model trains,
vision samples put the loss on their answers. Evaluation: held-out text loss, and the
loss and `answer_exact` of held-out vision samples.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging

from k25jax import losses
from k25jax.data import mixture, pipeline, sources, tokenizer
from k25jax.model import k25, transformer
from k25jax.model.config import K25Config
from k25jax.train import checkpoint, config_utils, loop, multimodal, optimizer, sharding, state as state_lib, step

LM = "language_model"


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


def make_step(config: ml_collections.ConfigDict, model: transformer.Transformer | k25.K25, tx):
  """The jitted train step (state, batch) -> (state, metrics); call under `jax.set_mesh`."""
  if isinstance(model, k25.K25):
    return make_joint_step(config, model, tx)
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
  if "vision" in config.model:
    return run_joint(config, workdir)
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


# ------------------------------------------------------------------------ joint vision–text
def make_joint_step(config: ml_collections.ConfigDict, model: k25.K25, tx):
  """(state, device batch) -> (state, metrics): one compilation for batches with media (padded
  to the patch budget) and one for text-only batches (before a late vision start)."""
  loss_fn = multimodal.make_loss(config, model)
  kw = dict(router_gamma=config.train.router_bias_rate, first_moe_layer=model.cfg.text.first_k_dense_replace,
            qk_clip_tau=optimizer.qk_clip_tau(config.optimizer), lm_key=LM)
  abstract = multimodal.abstract_state(model.cfg, tx)
  with_media = step.make_train_step(loss_fn, tx, abstract, batch_specs=multimodal.batch_specs(True), **kw)
  text_only = step.make_train_step(loss_fn, tx, abstract, batch_specs=multimodal.batch_specs(False), **kw)
  return lambda state, batch: (with_media if "pixel_values" in batch else text_only)(state, batch)


def joint_schedule(config) -> mixture.VisionSchedule:
  return mixture.VisionSchedule(config.data.vision_ratio, config.data.vision_schedule, config.data.vision_start)


def joint_datasets(config, tok):
  """(train mixture, held-out text batches, held-out vision batches)."""
  train_docs, eval_docs = sources.split(sources.load(config.data.source, config.data.max_doc_chars),
                                        config.data.eval_every)
  kw = dict(tok=tok, tasks=config.data.vision_tasks, batch=config.train.batch, seq_len=config.train.seq_len,
            total_steps=config.train.steps, max_patches=config.data.max_patches)
  train = mixture.mixture(docs=train_docs, schedule=joint_schedule(config), seed=config.train.seed, **kw)
  text = mixture.mixture(docs=eval_docs, schedule=mixture.VisionSchedule(0.0), seed=config.train.seed,
                         shuffle=False, **kw)
  vision = mixture.mixture(docs=None, schedule=mixture.VisionSchedule(1.0), seed=config.train.seed + 1, **kw)
  return (train, [next(text) for _ in range(config.train.eval_batches)],
          [next(vision) for _ in range(config.data.vision_eval_batches)])


def joint_evaluate(eval_steps, state, text_batches, vision_batches) -> dict[str, float]:
  """Held-out text loss/accuracy, and `vision_*` metrics of held-out vision samples (with
  train.eval_batches = data.vision_eval_batches = 0 the run does not evaluate)."""
  out = multimodal.evaluate(eval_steps[False], state, text_batches)
  out.pop("answer_exact", None)
  vision = multimodal.evaluate(eval_steps[True], state, vision_batches)
  return {**out, **{f"vision_{k}": v for k, v in vision.items()}}


def run_joint(config: ml_collections.ConfigDict, workdir: str, model_cfg: K25Config | None = None):
  """Joint vision–text pre-training (module docstring); `model_cfg` overrides the config's
  model (mid-training sets YaRN). Returns (state, history)."""
  multimodal.check_single_process(config.stage)
  tok = tokenizer.load(config.data.tokenizer, config.data.vocab_file, media=True)
  model_cfg = model_cfg or config_utils.k25_config_from(config.model, tok.media)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  check(config, model_cfg.text, tok, mesh)
  checkpoints = checkpoint.Checkpoints(workdir, keep=config.train.keep_checkpoints)
  writer = loop.MetricWriter(workdir)
  train_data, text_eval, vision_eval = joint_datasets(config, tok)
  model = k25.K25(model_cfg)
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  prepare = lambda b: multimodal.to_device(multimodal.device_features(b, model_cfg, config.data.max_patches), mesh)

  with jax.set_mesh(mesh):
    create, target = multimodal.init_state(config, model_cfg, tx, mesh)
    state = checkpoints.restore_latest(target, train_data)
    if state is None:
      state = create(multimodal.initial_params(config, model_cfg, mesh))
    schedule = joint_schedule(config)
    logging.info("%s: joint vision–text, vision share %s %.2f from %.0f%% of the steps (overall %.3f), "
                 "mesh %s, starting at step %d", config.stage, schedule.kind, schedule.ratio,
                 100 * schedule.start, schedule.overall_share, dict(mesh.shape), int(state.step))
    train_step = make_step(config, model, tx)
    abstract = multimodal.abstract_state(model_cfg, tx)
    eval_steps = {media: step.make_eval_step(multimodal.make_loss(config, model), abstract,
                                             batch_specs=multimodal.batch_specs(media)) for media in (False, True)}
    text_batches, vision_batches = [prepare(b) for b in text_eval], [prepare(b) for b in vision_eval]
    state, history = loop.train(
        state, train_step=train_step, next_batch=lambda: prepare(next(train_data)),
        total_steps=config.train.steps, tokens_per_step=config.train.batch * config.train.seq_len,
        log_every=config.train.log_every, eval_every=config.train.eval_every,
        checkpoint_every=config.train.checkpoint_every,
        evaluate_fn=(lambda s: joint_evaluate(eval_steps, s, text_batches, vision_batches))
        if text_batches and vision_batches else None,
        save_fn=lambda n, s: checkpoints.save(n, s, train_data), writer=writer)
  checkpoints.close()
  writer.close()
  return state, history
