"""Joint vision–text training of the K2.5 model: the recipe of the pretrain:joint and midtrain stages.

Per step, with packed rows (segment_ids, positions) that mix text with synthetic vision
samples (`k25jax.data.mixture`), the vision share by tokens following `data.vision_ratio` /
`vision_schedule` / `vision_start` (constant from step 0 is early fusion, a late start late
fusion), and loss mask w (vision samples put it on their answers):

    L = CE(θ) + z · mean_t (log Z_t)² + α · L_balance          (objective.next_token)
    θ ← AdamW or MuonClip(θ, ∇L)   (router biases excluded),   b_l ← b_l + γ · sign(mean(load_l) − load_l)

Every part of the model trains. Evaluation: held-out text loss, and the loss and
`answer_exact` of held-out vision samples (`vision_*`).
"""
from __future__ import annotations

import ml_collections
from absl import logging

from k25jax.data import image_text, mixture, sources
from k25jax.model import k25
from k25jax.model.config import K25Config
from k25jax.train import multimodal, objective, optimizer, sharding, trainer as trainer_lib


def schedule(config: ml_collections.ConfigDict) -> mixture.VisionSchedule:
  return mixture.VisionSchedule(config.data.vision_ratio, config.data.vision_schedule, config.data.vision_start)


def datasets(config: ml_collections.ConfigDict, tok, shards: int = 1):
  """(train mixture, held-out text batches, held-out vision batches), the rows in `shards`
  media shards."""
  train_docs, eval_docs = sources.text_documents(config.data)
  kw = dict(tok=tok, tasks=config.data.vision_tasks, batch=config.train.batch, seq_len=config.train.seq_len,
            total_steps=config.train.steps, max_patches=config.data.max_patches, shards=shards)
  train_pairs, held_out_pairs = image_text.vision_samples(config, tok, shards)
  train = mixture.mixture(docs=train_docs, schedule=schedule(config), seed=config.train.seed,
                          vision_sample=train_pairs, **kw)
  text = mixture.mixture(docs=eval_docs, schedule=mixture.VisionSchedule(0.0), seed=config.train.seed,
                         shuffle=False, **kw)
  vision = mixture.mixture(docs=None, schedule=mixture.VisionSchedule(1.0), seed=config.train.seed + 1,
                           vision_sample=held_out_pairs, **kw)
  return (train, [next(text) for _ in range(config.train.eval_batches)],
          [next(vision) for _ in range(config.data.vision_eval_batches)])


def evaluate(eval_steps, state, text_batches, vision_batches) -> dict[str, float]:
  """Held-out text loss/accuracy, and `vision_*` metrics of held-out vision samples."""
  out = multimodal.evaluate(eval_steps[False], state, text_batches)
  out.pop("answer_exact", None)
  vision = multimodal.evaluate(eval_steps[True], state, vision_batches)
  return {**out, **{f"vision_{k}": v for k, v in vision.items()}}


def make_step(config: ml_collections.ConfigDict, model: k25.K25, tx, media: bool, sharded_media: bool = False):
  """The jitted train step (state, batch) -> (state, metrics) of device batches with media
  (replicated, or in media shards: `sharded_media`) or text-only ones (`multimodal.batch_specs`);
  call under `jax.set_mesh`."""
  return trainer_lib.train_step(model, tx, objective.for_section(model, config.train),
                                router_bias_rate=config.train.router_bias_rate,
                                qk_clip_tau=optimizer.qk_clip_tau(config.optimizer),
                                batch_specs=multimodal.batch_specs(media, sharded_media=sharded_media))


def run(config: ml_collections.ConfigDict, workdir: str, model_cfg: K25Config, tok):
  """Joint training of `model_cfg` to `train.steps`, from `init` or the workdir; with
  train.eval_batches = data.vision_eval_batches = 0 it does not evaluate. Returns (state, history)."""
  model = k25.K25(model_cfg)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  trainer_lib.check_rows(config, tok, model, mesh)
  shards = multimodal.media_shards(config, mesh)
  train_data, text_eval, vision_eval = datasets(config, tok, shards)
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  with trainer_lib.Trainer.for_config(config, workdir, model, tx, mesh) as trainer:
    prepare = lambda b: multimodal.to_device(
        multimodal.device_features(b, model_cfg, config.data.max_patches, shards), trainer.mesh)
    state = trainer.start(config.init, train_data)
    plan = schedule(config)
    logging.info("%s: joint vision–text, vision share %s %.2f from %.0f%% of the steps (overall %.3f), "
                 "mesh %s, %d media shard(s), starting at step %d", config.stage, plan.kind, plan.ratio,
                 100 * plan.start, plan.overall_share, dict(trainer.mesh.shape), shards, int(state.step))
    loss_fn = objective.for_section(model, config.train)
    steps = {media: make_step(config, model, tx, media, shards > 1) for media in (True, False)}
    eval_steps = {media: trainer.eval_step(loss_fn, multimodal.batch_specs(media, sharded_media=shards > 1))
                  for media in (False, True)}
    text_batches, vision_batches = [prepare(b) for b in text_eval], [prepare(b) for b in vision_eval]
    return trainer.fit(state, multimodal.media_step(steps[True], steps[False]), lambda _: prepare(next(train_data)),
                       config.train, tokens_per_step=config.train.batch * config.train.seq_len,
                       evaluate=(lambda s: evaluate(eval_steps, s, text_batches, vision_batches))
                       if text_batches and vision_batches else None, data_iterator=train_data)
