# python -m k25jax.main --config=configs/vit.py --workdir=runs/vit
"""The ViT stage: MoonViT-3D + projector trained on captions of synthetic images and videos,
the language model frozen; from `vit.projector_only_from` on, the projector alone.

Preset: `tiny` (default; CPU, a few minutes): the tiny K2.5 (text backbone of the tiny
preset, 2-layer width-64 MoonViT-3D), byte tokenizer with media tokens, 56×56 images and
4-frame 56×56 videos. Start the language model from a text pretrain run with
`--config.init.text_checkpoint=runs/pretrain`.
"""
import ml_collections

from configs import common


def get_config(arg=None):
  preset, _ = common.preset_and_switches(arg, "configs/vit.py", ("tiny",))
  c = ml_collections.ConfigDict()
  c.stage = "vit"
  c.model = common.k25_model_section(preset)
  c.init = common.init_section(k25=True)

  c.data = ml_collections.ConfigDict(dict(
      tokenizer="bytes",                     # bytes | tiktoken | tokenizers | auto (with the media tokens)
      vocab_file="",
      tasks=common.VISUAL_TASKS,             # caption, count, read, chart, motion
      vision_source="synthetic",             # synthetic (the tasks above) | files: the user's image-text pairs
      vision_files="",                       # vision_source=files: "GLOB,..." of .jsonl {"image", "text"} lines
      eval_every=50,                         # vision_source=files: every 50th pair is held out
      max_patches=768,                       # the vision tower's patch budget per batch
      shard_media=False,                     # True: media split with the rows, one blob per data shard
  ))

  c.optimizer = common.optimizer_section(lr=2e-3, warmup_steps=10, decay_steps=50, name="muonclip")

  c.vit = ml_collections.ConfigDict(dict(
      projector_only_from=150,               # phase 2 (projector alone) from this step
  ))

  c.mesh = common.mesh_section()

  c.train = ml_collections.ConfigDict(dict(
      steps=200,
      batch=8,
      seq_len=128,
      log_every=10,
      eval_every=50,
      eval_batches=2,
      checkpoint_every=100,
      checkpoint_minutes=0.0, keep_checkpoints=2,
      seed=0,
      z_loss=1e-4,
      balance_loss_alpha=0.0,                # the language model is frozen
      max_consecutive_skipped=10,            # skipped (non-finite) updates in a row that stop the run
  ))
  common.follow_the_run(c)
  c.vit.projector_only_from = common.fit_to_run(c.vit.projector_only_from, c.train.get_ref("steps"), c.train.steps)
  return c
