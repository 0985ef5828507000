# python -m k25jax.main --config=configs/pretrain.py:tiny --workdir=runs/pretrain
"""Text-only pre-training (next-token prediction) of the K2 decoder.

Presets: `tiny` (default; CPU, a few minutes, byte tokenizer on the Python standard
library) and `small` (~0.9B total params, one GPU or a TPU slice, FSDP).
"""
import ml_collections

from k25jax.train.config_utils import model_section


def get_config(arg=None):
  preset = arg or "tiny"
  if preset not in ("tiny", "small"):
    raise ValueError(f"configs/pretrain.py: unknown preset {preset!r}; choose 'tiny' or 'small'")
  tiny = preset == "tiny"
  c = ml_collections.ConfigDict()
  c.stage = "pretrain"

  c.model = model_section(preset)

  c.data = ml_collections.ConfigDict(dict(
      source="python_stdlib",      # offline text, see k25jax/data/sources.py
      tokenizer="bytes",           # bytes | tiktoken
      vocab_file="",               # local tiktoken vocabulary when tokenizer='tiktoken'
      max_doc_chars=1000 if tiny else 8000,
      eval_every=50,               # every 50th document is held out for evaluation
  ))

  c.optimizer = ml_collections.ConfigDict(dict(
      name="adamw",                        # adamw | muonclip (Muon + QK-Clip, AdamW for the rest)
      lr=1e-3 if tiny else 6e-4,
      warmup_steps=20 if tiny else 500,     # warmup → stable → cosine decay (WSD)
      decay_steps=100 if tiny else 4000,
      final_lr_ratio=0.1,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=0.1,
      grad_clip=1.0,
      # muonclip only (b1, b2, eps above are its AdamW half's):
      momentum=0.95,                       # Nesterov momentum of Muon
      nesterov=True,
      ns_steps=5,                          # Newton–Schulz iterations
      rms_scale=0.2,                       # Muon update · rms_scale · sqrt(max(rows, cols))
      qk_clip_tau=100.0,                   # QK-Clip threshold τ on the max pre-softmax logit
  ))

  # Device counts per axis; -1 takes the devices left over.
  c.mesh = ml_collections.ConfigDict(dict(
      data=-1 if tiny else 1, fsdp=1 if tiny else -1, expert=1, sequence=1, tensor=1))

  c.train = ml_collections.ConfigDict(dict(
      steps=300 if tiny else 20000,
      batch=8 if tiny else 64,             # global batch, rows of seq_len tokens
      seq_len=128 if tiny else 2048,
      log_every=10 if tiny else 50,
      eval_every=100 if tiny else 1000,
      eval_batches=4 if tiny else 16,
      checkpoint_every=100 if tiny else 1000,
      keep_checkpoints=3,
      seed=0,
      router_bias_rate=1e-3,               # γ of the auxiliary-loss-free router-bias update
      balance_loss_alpha=1e-4,             # α of the sequence-wise balance loss
      z_loss=1e-4,
  ))
  return c
