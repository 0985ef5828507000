"""The ViT stage: MoonViT-3D and the projector learn to caption; the language model is frozen.

Per step, on batches of synthetic vision samples only (k25jax.data.mixture, ratio 1):

    L = CE over the answer tokens (captions, counts, read text, chart values, motion)
    phase 1, step < vit.projector_only_from:  θ_vit, θ_proj ← AdamW or MuonClip(θ, ∇L)
    phase 2, after:                           θ_proj ← AdamW or MuonClip(θ_proj, ∇L),  θ_vit fixed
    θ_LM frozen throughout (no gradient is computed for it; the optimizer sets its updates to 0)

The language model starts from `init.text_checkpoint` (a text pretrain workdir), or all
params from `init.checkpoint` (a K2.5 run's workdir), or from a random init. Held-out
vision samples (another seed) give the eval loss and `answer_exact`, the fraction of
samples whose whole answer greedy decoding would produce.
"""
from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import optax
from absl import logging

from k25jax.data import image_text, mixture, tokenizer
from k25jax.model import k25
from k25jax.train import config_utils, multimodal, objective, optimizer, sharding, trainer as trainer_lib

LM, VIT, PROJECTOR = k25.LANGUAGE_MODEL, k25.VISION_TOWER, k25.PROJECTOR


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """`optimizer.name` (AdamW or MuonClip; WSD schedule, clipped per part) on the tower and the
  projector, the tower's updates gated to 0 from step `vit.projector_only_from`; the language
  model never moves (and QK-Clip, which acts on it, is off in this stage)."""
  part = lambda: optimizer.make_optimizer(config.optimizer, config.train.steps)
  boundary = config.vit.projector_only_from
  vit_gate = optax.scale_by_schedule(lambda count: jnp.where(count < boundary, 1.0, 0.0))
  return optax.multi_transform({VIT: optax.chain(part(), vit_gate), PROJECTOR: part(),
                                LM: optax.set_to_zero()}, lambda params: {k: k for k in params})


def datasets(config, tok, shards: int = 1):
  """(train iterator, eval batches): vision samples only, eval from seed train.seed + 1, the
  rows in `shards` media shards."""
  kw = dict(docs=None, tok=tok, schedule=mixture.VisionSchedule(1.0), tasks=config.data.tasks,
            batch=config.train.batch, seq_len=config.train.seq_len, total_steps=config.train.steps,
            max_patches=config.data.max_patches, shards=shards)
  train_pairs, held_out_pairs = image_text.vision_samples(config, tok, shards)
  train = mixture.mixture(seed=config.train.seed, vision_sample=train_pairs, **kw)
  held_out = mixture.mixture(seed=config.train.seed + 1, vision_sample=held_out_pairs, **kw)
  return train, [next(held_out) for _ in range(config.train.eval_batches)]


def check(config) -> None:
  """The stage's config check (before anything is built): the schedule and both phases fit the
  run, the image source exists."""
  trainer_lib.check(config)
  image_text.check(config.data)
  if not 0 <= config.vit.projector_only_from <= config.train.steps:
    raise ValueError(f"config: vit.projector_only_from={config.vit.projector_only_from} must lie in "
                     f"[0, train.steps={config.train.steps}]")


def run(config: ml_collections.ConfigDict, workdir: str):
  """Trains to `config.train.steps`, resuming from the workdir. Returns (state, history)."""
  check(config)
  tok = tokenizer.load(config.data.tokenizer, config.data.vocab_file, media=True)
  model = k25.K25(config_utils.k25_config_from(config.model, tok))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  trainer_lib.check_rows(config, tok, model, mesh)
  shards = multimodal.media_shards(config, mesh)
  train_data, eval_data = datasets(config, tok, shards)
  prepare = lambda b: multimodal.to_device(
      multimodal.device_features(b, model.cfg, config.data.max_patches, shards), mesh)
  with trainer_lib.Trainer.for_config(config, workdir, model, make_optimizer(config), mesh) as trainer:
    state = trainer.start(config.init, train_data)
    logging.info("vit: projector only from step %d, LM %s, starting at step %d", config.vit.projector_only_from,
                 config.init.text_checkpoint or config.init.checkpoint or "random (frozen)", int(state.step))
    specs = multimodal.batch_specs(True, sharded_media=shards > 1)
    step = trainer.train_step(objective.for_section(model, config.train, frozen=(LM,)), router_bias_rate=0.0,
                              batch_specs=specs)   # the LM's router bias stays too
    eval_step = trainer.eval_step(objective.for_section(model, config.train), specs)
    eval_batches = [prepare(b) for b in eval_data]
    return trainer.fit(state, step, lambda _: prepare(next(train_data)), config.train,
                       tokens_per_step=config.train.batch * config.train.seq_len,
                       evaluate=lambda s: multimodal.evaluate(eval_step, s, eval_batches), data_iterator=train_data)
