"""Config files and their sections on the package side: a `model` section (made by
`configs/common.py`: the preset's name and every field at the preset's value) → its
`ModelConfig` / `K25Config`; loading a config file by path; `section.field=value` overrides.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import sys

import ml_collections

from k25jax.convert import hf
from k25jax.model import config as model_config


def model_config_from(section: ml_collections.ConfigDict) -> model_config.ModelConfig:
  fields = section.to_dict()
  fields.pop("preset")
  return model_config.ModelConfig(**fields)


def k25_config_from(section: ml_collections.ConfigDict, tok) -> model_config.K25Config:
  """The K25Config of a K2.5 `model` section, its media ids from the tokenizer `tok` (one with
  media tokens): placeholder = <|media_pad|>, vision start/end = begin/end; the video
  placeholder is put past the vocabulary (video chunks use <|media_pad|> too, so no token
  of ours is ever taken for one)."""
  vision = model_config.VisionConfig(**section.vision.to_dict())
  text = model_config.ModelConfig(**section.text.to_dict())
  media = tok.media
  return model_config.K25Config(text=text, vision=vision, projection_hidden_size=vision.hidden_size,
                                projection_layer_norm_eps=section.projection_layer_norm_eps,
                                image_token_id=media.pad, video_token_id=tok.vocab_size,
                                vision_start_token_id=media.begin, vision_end_token_id=media.end)


def put_checkout_on_path(config_path: str) -> None:
  """Makes `configs.common` importable for the config file at `config_path` (a file of a
  checkout's configs/ folder: its checkout goes first on sys.path)."""
  checkout = os.path.dirname(os.path.dirname(os.path.abspath(config_path)))
  if checkout not in sys.path:
    sys.path.insert(0, checkout)


def load_config_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file, loaded by path as `main.py`'s --config flag does."""
  put_checkout_on_path(path)
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(f"{name}_config_file", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> None:
  """Sets `section.field=value` pairs (values parsed as Python literals, else strings);
  an unknown field fails naming it, and numbers keep the field's type."""
  for item in overrides:
    path, _, text = item.partition("=")
    *sections, field = path.split(".")
    node = config
    for name in sections:
      node = node[name]
    if field not in node:
      raise ValueError(f"override {item!r}: no field {path!r} in the config")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    current = node[field]
    if isinstance(current, (int, float)) and not isinstance(current, bool):
      value = type(current)(value)
    node[field] = value


def model_section_from_hf(config: ml_collections.ConfigDict, given: set[str] | frozenset = frozenset()) -> list[str]:
  """Sets the fields of `config.model` that transformers knows to the values of
  `config.init.hf_checkpoint`'s config.json (the text model's; a K2.5 stage from a K2.5 folder
  also the vision tower's and the projector's); k25jax's own fields (`OURS`: layout, dtypes,
  kernels) stay the run's. `given`: the fields set on the command line (`hidden_size`,
  `text.hidden_size`, ...): one the folder disagrees with is a ValueError naming both values.
  Returns the fields it changed."""
  path = config.init.hf_checkpoint
  hf_cfg = hf.read_config(path)
  k25_run = "text" in config.model
  folder_text = hf.load_config(path)
  sections = [(config.model.text if k25_run else config.model, "text." if k25_run else "", folder_text,
               model_config.OURS)]
  if k25_run and "vision_config" in hf_cfg:
    folder = model_config.K25Config.from_hf_dict(hf_cfg)
    sections.append((config.model.vision, "vision.", folder.vision, model_config.VISION_OURS))
    sections.append((config.model, "", {"projection_layer_norm_eps": folder.projection_layer_norm_eps}, ()))
  changed = []
  for section, prefix, folder, ours in sections:
    values = folder if isinstance(folder, dict) else {f.name: getattr(folder, f.name) for f in dataclasses.fields(folder)}
    for name, value in values.items():
      if name in ours or name not in section:
        continue
      current = section[name]
      current = current.to_dict() if isinstance(current, ml_collections.ConfigDict) else current
      if current == value:
        continue
      if prefix + name in given:
        raise ValueError(f"--config.model.{prefix}{name}={current!r} disagrees with {os.path.join(path, 'config.json')}"
                         f" ({value!r}): drop the flag, or start from a folder of that model")
      with section.ignore_type():
        section[name] = value
      changed.append(prefix + name)
  return changed
