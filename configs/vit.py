# python -m k25jax.main --config=configs/vit.py --workdir=runs/vit
"""The ViT stage: MoonViT-3D + projector trained on captions of synthetic images and videos,
the language model frozen; from `vit.projector_only_from` on, the projector alone.

Preset: `tiny` (default; CPU, a few minutes): the tiny K2.5 (text backbone of the tiny
preset, 2-layer width-64 MoonViT-3D), byte tokenizer with media tokens, 56×56 images and
4-frame 56×56 videos. Start the language model from a text pretrain run with
`--config.train.init_lm_from=runs/pretrain`.
"""
import ml_collections

from k25jax.data import visual_synthetic
from k25jax.train.config_utils import adamw_section, k25_model_section


def get_config(arg=None):
  preset = arg or "tiny"
  if preset != "tiny":
    raise ValueError(f"configs/vit.py: unknown preset {preset!r}; choose 'tiny'")
  c = ml_collections.ConfigDict()
  c.stage = "vit"
  c.model = k25_model_section(preset)

  c.data = ml_collections.ConfigDict(dict(
      tokenizer="bytes",                     # bytes | tiktoken (with the media tokens)
      vocab_file="",
      tasks=visual_synthetic.TASKS,          # caption, count, read, chart, motion
      max_patches=768,                       # the vision tower's patch budget per batch
  ))

  c.optimizer = adamw_section(lr=2e-3, warmup_steps=10, decay_steps=50)

  c.vit = ml_collections.ConfigDict(dict(
      projector_only_from=150,               # phase 2 (projector alone) from this step
  ))

  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, sequence=1, tensor=1))

  c.train = ml_collections.ConfigDict(dict(
      steps=200,
      batch=8,
      seq_len=128,
      log_every=10,
      eval_every=50,
      eval_batches=2,
      checkpoint_every=100,
      keep_checkpoints=2,
      seed=0,
      z_loss=1e-4,
      balance_loss_alpha=0.0,                # the language model is frozen
      init_from="",                          # a K2.5 stage's workdir: start from all its params
      init_lm_from="",                       # a text pretrain workdir: start the language model from it
  ))
  return c
