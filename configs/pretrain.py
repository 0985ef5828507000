# python -m k25jax.main --config=configs/pretrain.py:tiny --workdir=runs/pretrain
"""Pre-training (next-token prediction): text-only of the K2 decoder, or joint vision–text
of the K2.5 model.

Presets: `tiny` (default; CPU, a few minutes, byte tokenizer on the Python standard
library), `small` (~0.9B total params, one GPU or a TPU slice, FSDP), `joint` (the
tiny K2.5 on text mixed with synthetic images and videos, 10% of the tokens vision from
step 0: `configs/pretrain.py:joint`), `moonlight` (Moonlight-16B-A3B, the size a researcher
trains on one host: start it from the released folder with `--config.init.hf_checkpoint=DIR
--config.data.vocab_file=DIR`; scanned layers, full remat, FSDP over the host's chips, 16 ×
4096 tokens a step) and `k25` (the released 1T text backbone on a TPU pod: scanned MoE layers, expert parallelism, MuonClip, 1024 × 4096 tokens a step;
`experiments/aot_compile.py` compiles its step for a pod from a CPU). Switch `joint` of k25
(`configs/pretrain.py:k25,joint`): the released K2.5 (MoonViT-3D + the 1T decoder) on the
same pod and batch, 10% of the tokens vision, media sharded with their rows (each of the
512 data shards encodes its own images, at most 4096 patches, through the segment-aware
flash kernel).
"""
import ml_collections

from configs import common

PRESETS = ("tiny", "small", "joint", "moonlight", "k25")
SWITCHES = ("joint",)
K25_SHARD_PATCHES = 4096     # k25,joint: the patch budget of each data shard


def get_config(arg=None):
  preset, switches = common.preset_and_switches(arg, "configs/pretrain.py", PRESETS, SWITCHES)
  if switches and preset != "k25":
    raise ValueError("configs/pretrain.py: the joint switch is for the k25 preset (the tiny one is the joint preset)")
  tiny = preset in ("tiny", "joint")
  k25 = preset == "k25"
  moonlight = preset == "moonlight"
  k25_joint = k25 and "joint" in switches
  joint = preset == "joint" or k25_joint
  c = ml_collections.ConfigDict()
  c.stage = "pretrain"

  # k25 on a pod: one compiled MoE layer body, layers recomputed in the backward, grouped matmuls.
  pod = dict(scan_layers=True, remat_policy="full", moe_impl="ragged_dot") if k25 or moonlight else {}
  if k25_joint:
    c.model = common.k25_model_section("k25", **pod)
    c.model.vision.attention_impl = "pallas"
  else:
    c.model = common.k25_model_section("tiny") if joint else common.model_section(preset, **pod)
  c.init = common.init_section(k25=joint)

  c.data = ml_collections.ConfigDict(dict(
      source="python_stdlib",      # offline text (k25jax/data/sources.py), or files: the user's, below
      files="",                    # source=files: "GLOB[:WEIGHT],..." of .jsonl/.jsonl.gz/.parquet, weights = token
                                   # shares (k25jax/data/files.py; joint pre-training takes one GLOB)
      eval_files="",               # source=files: held-out files ("GLOB,..."); '' = every eval_every-th document
      text_field="text",           # source=files: the field (column) holding a record's text
      on_bad_record="error",       # source=files: error (one line, exit 2) | skip (counted, reported once read)
      tokenizer="bytes",           # bytes | tiktoken | tokenizers | auto (a checkpoint folder)
      vocab_file="",               # a local tiktoken.model, tokenizer.json, or (auto) the folder holding one
      max_doc_chars=1000 if tiny else 8000,
      eval_every=50,               # every 50th document is held out for evaluation
  ))
  if joint:   # k25jax/data/mixture.py: the vision share by tokens over training
    c.data.update(dict(
        vision_ratio=0.1,                    # r: vision share of the tokens once vision has started
        vision_schedule="constant",          # constant | ramp (linear from 0 at the start to r at the end)
        vision_start=0.0,                    # fraction of the steps before vision starts (0: early fusion)
        vision_tasks=common.VISUAL_TASKS,
        vision_source="synthetic",           # synthetic (vision_tasks) | files: image-text pairs (data/image_text.py)
        vision_files="",                     # vision_source=files: "GLOB,..." of .jsonl {"image", "text"} lines
        max_patches=256,                     # the vision tower's patch budget per batch
        shard_media=False,                   # True: media split with the rows, one blob per data shard
        vision_eval_batches=2,               # held-out vision-only batches per evaluation
    ))

  c.optimizer = common.optimizer_section(1e-3 if tiny else 6e-4, 20 if tiny else 500, 100 if tiny else 4000,
                                         name="muonclip" if joint or k25 else "adamw", weight_decay=0.1)

  # Device counts per axis; -1 takes the devices left over.
  c.mesh = common.mesh_section() if tiny else common.mesh_section(data=1, fsdp=-1)

  c.train = ml_collections.ConfigDict(dict(
      steps=300 if tiny else 20000,
      batch=8 if tiny else 64,             # global batch, rows of seq_len tokens
      seq_len=128 if tiny else 2048,
      log_every=10 if tiny else 50,
      eval_every=100 if tiny else 1000,
      eval_batches=4 if tiny else 16,
      checkpoint_every=100 if tiny else 1000,
      checkpoint_minutes=0.0, keep_checkpoints=3,
      seed=0,
      router_bias_rate=1e-3,               # γ of the auxiliary-loss-free router-bias update
      balance_loss_alpha=1e-4,             # α of the sequence-wise balance loss
      z_loss=1e-4,
      max_consecutive_skipped=10,        # skipped (non-finite) updates in a row that stop the run
  ))
  if k25:   # a pod: 64-way expert parallel (6 experts a chip), FSDP over the rest; 4.2M tokens a step
    c.optimizer.lr = 2e-4
    c.mesh.update(fsdp=-1, expert=64)
    c.train.update(batch=1024, seq_len=4096)
  if moonlight:   # continued training of the released model on one host (e.g. a TPU v5p 2x2x1)
    c.data.tokenizer = "auto"
    c.optimizer.update(name="muonclip", lr=2e-5, warmup_steps=100, decay_steps=1000)
    c.train.update(steps=2000, batch=16, seq_len=4096)
  if k25_joint:   # 512 data shards (fsdp=8 x expert=64) of 2 rows, each with its own media
    c.data.update(max_patches=K25_SHARD_PATCHES * 512, shard_media=True)
  common.follow_the_run(c)
  return c
