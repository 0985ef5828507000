"""A trained model from disk, whatever wrote it: a k25jax workdir or a Hugging Face folder.

    saved = saved_model.load(path)        # one device; saved.cfg, saved.params, saved.tokenizer

* a workdir (it holds `model_config.json`): the model its run recorded (`model_record`), the
  params of its newest checkpoint, or of checkpoint `step`, and the tokenizer the record
  names (`chat_formats.tokenizer_from_record`; None when the stage's vocabulary is its own);
* an HF folder (it holds `config.json`): `hf.load`'s model and params, and the folder's
  tokenizer (`tokenizer.json` or `tiktoken.model`; a K2.5 folder's with its media tokens),
  read as the legacy chat tokenizer when it carries k25jax's legacy role tokens (the folder
  of an exported legacy-format run).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from k25jax.convert import hf
from k25jax.data import chat_formats, tokenizer as tokenizer_lib
from k25jax.model import k25, transformer
from k25jax.model.config import K25Config, ModelConfig
from k25jax.train import model_record, sharding, trainer as trainer_lib


@dataclasses.dataclass
class SavedModel:
  cfg: ModelConfig | K25Config
  params: Any                # K2.5: {language_model, vision_tower, mm_projector}; text: the decoder's
  tokenizer: Any             # the tokenizer its prompts are written with, or None
  source: str                # "workdir" | "hf"
  tokenizer_record: dict | None = None    # a workdir's (`model_record`)

  @property
  def text_cfg(self) -> ModelConfig:
    return self.cfg.text if isinstance(self.cfg, K25Config) else self.cfg

  @property
  def text_params(self):
    return self.params[k25.LANGUAGE_MODEL] if isinstance(self.cfg, K25Config) else self.params


def load(path: str, step: int | None = None) -> SavedModel:
  """The model at `path` (module docstring) on this host's first device; `step` (workdirs
  only): that checkpoint instead of the newest."""
  if os.path.isfile(os.path.join(path, model_record.FILE)):
    return load_workdir(path, step)
  if os.path.isfile(os.path.join(path, "config.json")):
    if step is not None:
      raise ValueError(f"{path} is a Hugging Face folder (one set of weights): --step is for k25jax workdirs")
    return load_folder(path)
  raise FileNotFoundError(f"{path!r} is neither a k25jax workdir ({model_record.FILE}) nor a Hugging Face folder "
                          "(config.json)")


def load_workdir(workdir: str, step: int | None = None) -> SavedModel:
  """A k25jax run's model, its newest params (or checkpoint `step`'s) and recorded tokenizer."""
  cfg, record = model_record.read(workdir)
  model = k25.K25(cfg) if isinstance(cfg, K25Config) else transformer.Transformer(cfg)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  params = trainer_lib.restore_params(model, workdir, mesh, step=step)
  return SavedModel(cfg, params, chat_formats.tokenizer_from_record(record) if record else None, "workdir", record)


def load_folder(path: str) -> SavedModel:
  """A Hugging Face folder's model, params and tokenizer."""
  cfg, params = hf.load(path)
  return SavedModel(cfg, params, _folder_tokenizer(path, isinstance(cfg, K25Config)), "hf")


def _folder_tokenizer(path: str, media: bool):
  try:
    tok = tokenizer_lib.load("auto", path, media=media)
  except FileNotFoundError:
    return None
  return chat_formats.as_legacy(tok)
