# python -m k25jax.main --config=configs/midtrain.py --workdir=runs/midtrain
"""Long-context mid-training of the K2.5 model: joint vision–text rows of 1024 tokens with
YaRN (factor 4 over a 256-token original context), activations and attention sharded
along the `sequence` mesh axis (every device, by default).

Preset: `tiny` (default; CPU). Start from joint pre-training with
`--config.init.checkpoint=runs/pretrain_joint`.
"""
import ml_collections

from configs import common


def get_config(arg=None):
  preset, _ = common.preset_and_switches(arg, "configs/midtrain.py", ("tiny",))
  c = ml_collections.ConfigDict()
  c.stage = "midtrain"
  c.model = common.k25_model_section(preset)
  c.init = common.init_section(k25=True)

  c.long_context = ml_collections.ConfigDict(dict(
      yarn_factor=4.0,                     # max positions = yarn_factor x original_context
      original_context=256,                # the context the model was pre-trained at
      beta_fast=32.0,
      beta_slow=1.0,
  ))

  c.data = ml_collections.ConfigDict(dict(
      source="python_stdlib",
      tokenizer="bytes",
      vocab_file="",
      max_doc_chars=8000,                  # long documents, packed into rows of train.seq_len
      eval_every=50,
      vision_ratio=0.1,
      vision_schedule="constant",
      vision_start=0.0,
      vision_tasks=common.VISUAL_TASKS,
      max_patches=1024,
      vision_eval_batches=1,
  ))

  c.optimizer = common.optimizer_section(lr=3e-4, warmup_steps=5, decay_steps=20, name="muonclip",
                                         weight_decay=0.1)

  c.mesh = common.mesh_section(data=1, sequence=-1)

  c.train = ml_collections.ConfigDict(dict(
      steps=40,
      batch=2,
      seq_len=1024,
      log_every=5,
      eval_every=20,
      eval_batches=2,
      checkpoint_every=20,
      keep_checkpoints=2,
      seed=0,
      router_bias_rate=1e-3,
      balance_loss_alpha=1e-4,
      z_loss=1e-4,
      max_consecutive_skipped=10,          # skipped (non-finite) updates in a row that stop the run
  ))
  return c
