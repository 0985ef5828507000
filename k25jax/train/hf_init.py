"""A run's first params from a Hugging Face folder (`init.hf_checkpoint`).

The folder's config.json must describe the run's model (every field transformers knows; the
layout, dtype and kernel fields of `config.OURS` are the run's own): `model_section_from_hf`
(k25jax/train/config_utils.py) sets the run's model section from it, as
`python -m k25jax.main` does. Which params come from where:

    run model    folder             params
    text         text (DeepSeek-V3)  all
    text         K2.5                its language model
    K2.5         K2.5                all: language model, vision tower, projector
    K2.5         text                the language model; the tower and projector fresh

Tensors stream into the run's shardings as they are read (`hf.load(path, shardings)`), INT4
experts and FP8 weights dequantized on the way.
"""
from __future__ import annotations

import dataclasses

from k25jax.convert import hf
from k25jax.model import k25
from k25jax.model.config import OURS, K25Config, own_fields


def differences(run, folder, prefix: str = "") -> list[str]:
  """`field (run X, folder Y)` for each field transformers knows on which two configs differ."""
  out = []
  for field in dataclasses.fields(run):
    name = field.name
    if name in OURS or name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
      continue            # the media ids come from the run's tokenizer
    mine, theirs = getattr(run, name), getattr(folder, name)
    if dataclasses.is_dataclass(mine):
      out += differences(mine, theirs, f"{prefix}{name}.")
    elif mine != theirs:
      out.append(f"{prefix}{name} (run {mine!r}, folder {theirs!r})")
  return out


def _check(path: str, run, folder) -> None:
  diff = differences(run, folder)
  if diff:
    raise ValueError(f"init.hf_checkpoint={path!r}: its config.json describes another model: {'; '.join(diff)}. "
                     "Take the model section from the folder (python -m k25jax.main does; in Python, "
                     "config_utils.model_section_from_hf(config)), or start from a folder of this model")


def load_params(model, path: str, shardings, fresh):
  """The run's first params from the folder at `path`, placed on `shardings` (the params'
  tree of shardings); `fresh()` gives fresh params where the folder has none (a K2.5 run
  from a text folder)."""
  cfg = model.cfg
  text = cfg.text if isinstance(cfg, K25Config) else cfg
  ours = own_fields(cfg)
  multimodal = "vision_config" in hf.read_config(path)
  if isinstance(cfg, K25Config) and multimodal:
    loaded_cfg, params = hf.load(path, shardings, **ours)
    _check(path, cfg, loaded_cfg)
    return params
  target = shardings[k25.LANGUAGE_MODEL] if isinstance(cfg, K25Config) else shardings
  loaded_cfg, params = hf.load(path, target, text_only=True, **ours)
  _check(path, text, loaded_cfg)
  if isinstance(cfg, K25Config):
    return {**fresh(), k25.LANGUAGE_MODEL: params}
  return params
