"""A run's newest params as a Hugging Face folder (what `python -m k25jax.export` writes).

The model comes from the workdir's `model_config.json` (written by every run when it starts),
the params from its newest checkpoint (any stage's, whatever its optimizer), restored onto
this host's first device. The folder gets config.json (DeepseekV3ForCausalLM for a text run,
Kimi_K25ForConditionalGeneration with the vision tower and projector for a K2.5 run), the
safetensors shards (with their index when there are several), generation_config.json
(greedy, the tokenizer's BOS/EOS) and the tokenizer's files (k25jax/convert/hf_tokenizer.py)
where the run's stage names one (`data.tokenizer`: pre-training, ViT, mid-training).

Not yet: tokenizer files for the chat stages (SFT, RL, PARL: their tokenizer is the legacy
chat format's, recorded by none), INT4 export of the routed experts, `--step` (the newest
checkpoint only).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import logging

from k25jax.convert import hf, hf_tokenizer
from k25jax.model import k25, transformer
from k25jax.model.config import K25Config
from k25jax.train import model_record, sharding, trainer as trainer_lib


def export(workdir: str, out: str, dtype: str = "float32") -> str:
  """Writes the newest params of `workdir` to `out` as an HF folder; returns `out`."""
  cfg, tokenizer = model_record.read(workdir)
  model = k25.K25(cfg) if isinstance(cfg, K25Config) else transformer.Transformer(cfg)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  params = jax.device_get(trainer_lib.restore_params(model, workdir, mesh))
  if dtype != "float32":
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                          params)
  hf.save(cfg, params, out)
  hf_tokenizer.write(tokenizer, out)
  if not tokenizer:
    logging.warning("%s names no tokenizer (its stage's config has no data.tokenizer): %s has no tokenizer files",
                    workdir, out)
  return out
