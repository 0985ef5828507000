"""The `model` section of a stage config ↔ `ModelConfig`.

The section holds the preset's name and every `ModelConfig` field at the preset's
value, so `--config.model.num_hidden_layers=2` overrides one field and a misspelt
field fails.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os

import ml_collections

from k25jax.model import config as model_config


def model_section(preset: str, **overrides) -> ml_collections.ConfigDict:
  fields = dataclasses.asdict(model_config.preset(preset, **overrides))
  return ml_collections.ConfigDict({"preset": preset, **fields})


def model_config_from(section: ml_collections.ConfigDict) -> model_config.ModelConfig:
  fields = section.to_dict()
  fields.pop("preset")
  return model_config.ModelConfig(**fields)


def k25_model_section(preset: str, **text_overrides) -> ml_collections.ConfigDict:
  """The `model` section of a multimodal stage: every `ModelConfig` field under `text`,
  every `VisionConfig` field under `vision`, and the projector's LayerNorm eps."""
  cfg = model_config.k25_preset(preset)
  text = dataclasses.asdict(cfg.text.replace(**text_overrides))
  vision = dataclasses.asdict(cfg.vision)
  return ml_collections.ConfigDict({"preset": preset, "text": text, "vision": vision,
                                    "projection_layer_norm_eps": cfg.projection_layer_norm_eps})


def k25_config_from(section: ml_collections.ConfigDict, media_ids) -> model_config.K25Config:
  """The K25Config of a `k25_model_section`, its media ids from the tokenizer's
  (`tokenizer.MediaIds`): placeholder = <|media_pad|>, vision start/end = begin/end."""
  vision = model_config.VisionConfig(**section.vision.to_dict())
  text = model_config.ModelConfig(**section.text.to_dict())
  video_id = max(media_ids) + 1   # never in our token stream: video chunks use <|media_pad|> too
  return model_config.K25Config(text=text, vision=vision, projection_hidden_size=vision.hidden_size,
                                projection_layer_norm_eps=section.projection_layer_norm_eps,
                                image_token_id=media_ids.pad, video_token_id=video_id,
                                vision_start_token_id=media_ids.begin, vision_end_token_id=media_ids.end)


def adamw_section(lr: float, warmup_steps: int, decay_steps: int, *, weight_decay: float = 0.0,
                  b2: float = 0.95, grad_clip: float = 1.0) -> ml_collections.ConfigDict:
  """An `optimizer` section for AdamW under the WSD schedule (k25jax.train.optimizer)."""
  return ml_collections.ConfigDict(dict(name="adamw", lr=lr, warmup_steps=warmup_steps, decay_steps=decay_steps,
                                        final_lr_ratio=0.1, b1=0.9, b2=b2, eps=1e-8, weight_decay=weight_decay,
                                        grad_clip=grad_clip))


def load_config_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file, loaded by path as `main.py`'s --config flag does."""
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
