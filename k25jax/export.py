"""Export a run's params as a Hugging Face folder that transformers loads.

    python -m k25jax.export --workdir=RUN --out=DIR [--dtype=float32|bfloat16]

The model comes from the workdir's `model_config.json` (written by every run when it starts),
the params from its newest checkpoint (any stage's, whatever its optimizer), restored onto
this host's first device. DIR gets config.json (DeepseekV3ForCausalLM for a text run,
Kimi_K25ForConditionalGeneration with the vision tower and projector for a K2.5 run), the
safetensors shards (with their index when there are several) and generation_config.json
(greedy decoding).

Not yet written: the run's tokenizer files and chat template (a run does not record its
tokenizer), INT4 export of the routed experts, and `--step` (the newest checkpoint only).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
from absl import app, flags

from k25jax.convert import hf
from k25jax.model import k25, transformer
from k25jax.model.config import K25Config
from k25jax.train import model_record, sharding, trainer as trainer_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "The run to export (a k25jax workdir).")
_OUT = flags.DEFINE_string("out", None, "The folder to write.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "The dtype of the exported weights.")


def export(workdir: str, out: str, dtype: str = "float32") -> str:
  """Writes the newest params of `workdir` to `out` as an HF folder; returns `out`."""
  cfg = model_record.read(workdir)
  model = k25.K25(cfg) if isinstance(cfg, K25Config) else transformer.Transformer(cfg)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  params = jax.device_get(trainer_lib.restore_params(model, workdir, mesh))
  if dtype != "float32":
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                          params)
  hf.save(cfg, params, out)
  with open(os.path.join(out, "generation_config.json"), "w") as f:   # greedy; the ids of BOS/EOS come with
    json.dump({"do_sample": False}, f, indent=2)                     # the tokenizer files (not yet written)
  return out


def main(argv):
  del argv
  if not _WORKDIR.value or not _OUT.value:
    raise app.UsageError("--workdir and --out are required")
  print(f"exported {_WORKDIR.value} to {export(_WORKDIR.value, _OUT.value, _DTYPE.value)}")


if __name__ == "__main__":
  app.run(main)
