"""A run's params as a Hugging Face folder (what `python -m k25jax.export` writes).

The model comes from the workdir's `model_config.json` (written by every run when it starts),
the params from its newest checkpoint or the one of `step` (any stage's, whatever its
optimizer), restored onto this host's first device (`saved_model.load_workdir`). The folder gets
config.json (DeepseekV3ForCausalLM for a text run, Kimi_K25ForConditionalGeneration with the
vision tower and projector for a K2.5 run), the safetensors shards (with their index when
there are several), generation_config.json (greedy, the tokenizer's BOS/EOS) and the
tokenizer's files (k25jax/convert/hf_tokenizer.py) where the run's stage names one
(`data.tokenizer`: pre-training, ViT, mid-training; the legacy chat tokenizer of SFT, RL and
PARL in the chat rendering, without a chat template).

`int4_group` (`--int4`): the routed experts as compressed-tensors pack-quantized INT4
(symmetric, groups of 32 input columns, bfloat16 scales: the released K2.5 layout,
`hf.save`), the rest in `dtype`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import logging

from k25jax.convert import hf, hf_tokenizer
from k25jax.train import saved_model


def export(workdir: str, out: str, dtype: str = "float32", step: int | None = None, int4_group: int | None = None
           ) -> str:
  """Writes the newest params of `workdir` (or checkpoint `step`'s) to `out` as an HF folder,
  the routed experts pack-quantized to INT4 in groups of `int4_group` when given; returns `out`."""
  saved = saved_model.load_workdir(workdir, step)
  params = jax.device_get(saved.params)
  if dtype != "float32":
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                          params)
  hf.save(saved.cfg, params, out, int4_group=int4_group)
  hf_tokenizer.write(saved.tokenizer_record, out)
  if not saved.tokenizer_record:
    logging.warning("%s names no tokenizer (its stage's vocabulary is its own: the compact addition task or the "
                    "PARL DSL): %s has no tokenizer files", workdir, out)
  return out
