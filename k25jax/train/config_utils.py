"""The `model` section of a stage config ↔ `ModelConfig`.

The section holds the preset's name and every `ModelConfig` field at the preset's
value, so `--config.model.num_hidden_layers=2` overrides one field and a misspelt
field fails.
"""
from __future__ import annotations

import dataclasses

import ml_collections

from k25jax.model import config as model_config


def model_section(preset: str, **overrides) -> ml_collections.ConfigDict:
  fields = dataclasses.asdict(model_config.preset(preset, **overrides))
  return ml_collections.ConfigDict({"preset": preset, **fields})


def model_config_from(section: ml_collections.ConfigDict) -> model_config.ModelConfig:
  fields = section.to_dict()
  fields.pop("preset")
  return model_config.ModelConfig(**fields)
