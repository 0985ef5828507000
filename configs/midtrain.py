# python -m k25jax.main --config=configs/midtrain.py --workdir=runs/midtrain
"""Long-context mid-training of the K2.5 model with YaRN, activations and attention sharded
along the `sequence` mesh axis.

Presets:
* `tiny` (default; CPU): joint vision–text rows of 1024 tokens, YaRN factor 4 over a
  256-token original context, every device along `sequence`.
* `k25` (`configs/midtrain.py:k25`): the released K2.5 on a TPU pod, the paper's first phase:
  rows of 32K tokens, YaRN as released (factor 64 over 4096 original positions, so
  262,144 max positions), 128 rows a step (4.2M tokens, as pretrain:k25), the MoE layers
  scanned and recomputed in the backward, the Pallas MLA flash kernel (K/V tiled, each
  device on whole rows of its heads), 64-way expert parallel and each row split 8 ways
  along `sequence` (whole axes of a v5p 8×8×8), FSDP over the rest (none there).
  Switch `262k` (`configs/midtrain.py:k25,262k`): the second phase, 16 rows of 262,144
  tokens, 16-way expert parallel and 32-way along `sequence`.
  `experiments/aot_compile.py --config=configs/midtrain.py:k25` compiles its step for a pod.

Start from joint pre-training with `--config.init.checkpoint=runs/pretrain_joint`.
"""
import ml_collections

from configs import common

PRESETS = ("tiny", "k25")
SWITCHES = ("262k",)


def get_config(arg=None):
  preset, switches = common.preset_and_switches(arg, "configs/midtrain.py", PRESETS, SWITCHES)
  k25 = preset == "k25"
  if "262k" in switches and not k25:
    raise ValueError("configs/midtrain.py: the 262k switch is for the k25 preset")
  c = ml_collections.ConfigDict()
  c.stage = "midtrain"
  pod = dict(scan_layers=True, remat_policy="full", moe_impl="ragged_dot", attention_impl="pallas") if k25 else {}
  c.model = common.k25_model_section(preset, **pod)
  c.init = common.init_section(k25=True)

  c.long_context = ml_collections.ConfigDict(dict(
      yarn_factor=64.0 if k25 else 4.0,    # max positions = yarn_factor x original_context
      original_context=4096 if k25 else 256,   # the context the model was pre-trained at
      beta_fast=32.0,
      beta_slow=1.0,
  ))

  c.data = ml_collections.ConfigDict(dict(
      source="python_stdlib",              # or files (one GLOB of .jsonl/.jsonl.gz/.parquet: k25jax/data/files.py)
      files="",
      eval_files="",
      text_field="text",
      on_bad_record="error",
      tokenizer="bytes",
      vocab_file="",
      max_doc_chars=8000,                  # long documents, packed into rows of train.seq_len
      eval_every=50,
      vision_ratio=0.1,
      vision_schedule="constant",
      vision_start=0.0,
      vision_tasks=common.VISUAL_TASKS,
      vision_source="synthetic",
      vision_files="",
      max_patches=1024,
      shard_media=False,                     # True: media split with the rows, one blob per data shard
      vision_eval_batches=1,
  ))

  c.optimizer = common.optimizer_section(lr=2e-4 if k25 else 3e-4, warmup_steps=50 if k25 else 5,
                                         decay_steps=200 if k25 else 20, name="muonclip", weight_decay=0.1)

  c.mesh = common.mesh_section(data=1, sequence=-1)

  c.train = ml_collections.ConfigDict(dict(
      steps=40,
      batch=2,
      seq_len=1024,
      log_every=5,
      eval_every=20,
      eval_batches=2,
      checkpoint_every=20,
      checkpoint_minutes=0.0, keep_checkpoints=2,
      seed=0,
      router_bias_rate=1e-3,
      balance_loss_alpha=1e-4,
      z_loss=1e-4,
      max_consecutive_skipped=10,          # skipped (non-finite) updates in a row that stop the run
  ))
  if k25:   # a pod: 4.2M tokens a step, 8K tokens on each chip
    long_rows = "262k" in switches
    c.mesh.update(data=1, fsdp=-1, expert=16 if long_rows else 64, sequence=32 if long_rows else 8)
    c.train.update(steps=1000, log_every=10, eval_every=100, checkpoint_every=100,
                   batch=16 if long_rows else 128, seq_len=262144 if long_rows else 32768)
  common.follow_the_run(c)
  return c
