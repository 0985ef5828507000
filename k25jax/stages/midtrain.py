"""Long-context mid-training: joint vision–text training (`k25jax.train.joint`) on long packed rows, with YaRN.

    rope_scaling = YaRN(factor = long_context.yarn_factor,
                        original_max_position_embeddings = long_context.original_context,
                        beta_fast, beta_slow, mscale = mscale_all_dim = 1)
    max_position_embeddings = factor · original_context      (what transformers recomputes
                                                               the factor from: kept consistent)
    rows of train.seq_len ≤ max_position_embeddings tokens, text documents of up to
    data.max_doc_chars packed with vision samples (k25jax.data.mixture)
    activations, attention included, sharded along the `sequence` mesh axis
    (logical axis activation_length → sequence; mesh.sequence = -1 takes every device)

Start from joint pre-training's workdir with `--config.init.checkpoint=runs/pretrain_joint`.
At k25 size this is the paper's 32K → 262K stretch: original_context 4096, factor 64.
"""
from __future__ import annotations

import ml_collections

from k25jax.data import sources, tokenizer
from k25jax.model.config import K25Config
from k25jax.train import config_utils, joint, trainer as trainer_lib


def yarn_scaling(long_context: ml_collections.ConfigDict) -> dict:
  """The DeepSeek YaRN `rope_scaling` dict of the `long_context` section."""
  if long_context.yarn_factor < 1:
    raise ValueError(f"long_context.yarn_factor must be >= 1, got {long_context.yarn_factor}")
  return dict(rope_type="yarn", factor=float(long_context.yarn_factor),
              original_max_position_embeddings=int(long_context.original_context),
              beta_fast=float(long_context.beta_fast), beta_slow=float(long_context.beta_slow),
              mscale=1.0, mscale_all_dim=1.0)


def max_positions(long_context: ml_collections.ConfigDict) -> int:
  """The YaRN context: yarn_factor · original_context."""
  return int(round(long_context.yarn_factor * long_context.original_context))


def check(config: ml_collections.ConfigDict) -> None:
  """The stage's config check (before anything is built): the schedule fits the run, and the
  rows fit the YaRN context."""
  trainer_lib.check(config)
  sources.check(config.data)
  if config.train.seq_len > max_positions(config.long_context):
    raise ValueError(f"config: train.seq_len={config.train.seq_len} exceeds the YaRN context "
                     f"long_context.yarn_factor x original_context = {max_positions(config.long_context)}")


def long_context_model(config: ml_collections.ConfigDict, tok) -> K25Config:
  """The config's K2.5 model with YaRN and max positions = factor · original context."""
  cfg = config_utils.k25_config_from(config.model, tok)
  lc = config.long_context
  return cfg.replace(text=cfg.text.replace(rope_scaling=yarn_scaling(lc), max_position_embeddings=max_positions(lc)))


def run(config: ml_collections.ConfigDict, workdir: str):
  """Trains to `config.train.steps` (resuming from the workdir). Returns (state, history)."""
  check(config)
  tok = tokenizer.load(config.data.tokenizer, config.data.vocab_file, media=True)
  return joint.run(config, workdir, long_context_model(config, tok), tok)
