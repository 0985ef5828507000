"""What model a run trains, written into its workdir (`model_config.json`) so that tools which
get only the workdir (k25jax.export) rebuild it: the config.json transformers reads
(`to_hf_dict`), k25jax's own fields of the text model (`config.OURS`: layout, dtypes,
kernels), which decide how the checkpoint's params are laid out, and the tokenizer
(`tokenizer.load`'s arguments) where the stage's config names one (`data.tokenizer`).
"""
from __future__ import annotations

import json
import os

from k25jax.model.config import K25Config, ModelConfig, own_fields

FILE = "model_config.json"


def write(workdir: str, cfg: ModelConfig | K25Config, tokenizer: dict | None = None) -> None:
  """`tokenizer`: {"name", "path", "media"} as `tokenizer.load` takes them, or None."""
  record = {"hf_config": cfg.to_hf_dict(), "ours": own_fields(cfg), "tokenizer": tokenizer}
  path = os.path.join(workdir, FILE)
  os.makedirs(workdir, exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(record, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)


def read(workdir: str) -> tuple[ModelConfig | K25Config, dict | None]:
  """(the model's config, the tokenizer's record or None)."""
  path = os.path.join(workdir, FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: {workdir!r} is not the workdir of a k25jax run "
                            "(runs write it when they start)")
  with open(path) as f:
    record = json.load(f)
  build = K25Config if "vision_config" in record["hf_config"] else ModelConfig
  return build.from_hf_dict(record["hf_config"], **record["ours"]), record.get("tokenizer")
