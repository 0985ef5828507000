"""Hugging Face K2.5 checkpoints ⇄ K25 params: the vision tower and projector tensors.

    cfg, params = hf.load(path)          # a folder with config.json's `vision_config`
    hf.save(cfg, params, path)           # `Kimi_K25ForConditionalGeneration.from_pretrained` loads it

`hf` drives both: on load its pass over the text model's files hands every vision or
projector tensor to the hook of `reader`; on save it writes `to_hf_tensors` after the
text model's tensors (under `language_model.`).

Tensor layouts understood on load (one checkpoint may mix the first two):
* released (moonshotai/Kimi-K2.5; also what transformers' save_pretrained writes):
  `vision_tower.patch_embed.proj`, `vision_tower.patch_embed.pos_emb.weight`,
  `vision_tower.encoder.blocks.{i}.{norm0,wqkv,wo,norm1,mlp.fc0,mlp.fc1}`,
  `vision_tower.encoder.final_layernorm`, `mm_projector.{pre_norm,proj.0,proj.2}`;
  transformers' writer spells two of them `vision_tower.encoder.patch_embed.*` and
  `model.mm_projector.pre_norm.*`. The qkv rows of each head rotate ADJACENT pairs, as ours.
* transformers' in-memory names (`save_original_format=False`): `model.vision_tower.
  layers.{i}.{norm1,attn.{q,k,v}_proj,attn.proj,norm2,mlp.fc1,mlp.fc2}`, `model.vision_tower.
  final_layernorm`, `...pos_emb.position_embeddings`, `model.mm_projector.{pre_norm,in_proj,
  out_proj}`. Their q/k rows are permuted for rotate-half RoPE: row r·d/2 + k of a head is
  our channel 2k + r (transformers' `PermuteForRope`), undone here.
Saving writes the released layout, which transformers maps itself (its `conversion_mapping`).
"""
from __future__ import annotations

import re
from typing import Any, Iterator

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from k25jax.convert.common import FLOAT, CheckpointError, at, require_dtype, shape_error
from k25jax.model import k25
from k25jax.model.config import K25Config, VisionConfig
from k25jax.model.layers import dtype_of

VISION, PROJECTOR, TEXT = k25.VISION_TOWER, k25.PROJECTOR, k25.LANGUAGE_MODEL

# Equivalent spellings → the released name (prefix rewrites, applied in order).
_PREFIXES = (
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
    ("model.vision_tower.patch_embed.pos_emb.position_embeddings", "vision_tower.patch_embed.pos_emb.weight"),
    ("model.vision_tower.patch_embed.", "vision_tower.patch_embed."),
    ("model.vision_tower.final_layernorm.", "vision_tower.encoder.final_layernorm."),
    ("model.vision_tower.layers.", "native.blocks."),
    ("model.mm_projector.in_proj.", "mm_projector.proj.0."),
    ("model.mm_projector.out_proj.", "mm_projector.proj.2."),
    ("model.mm_projector.", "mm_projector."),
)
# transformers' in-memory block names → the released ones; q/k/v are handled apart.
_NATIVE_BLOCK = {"norm1": "norm0", "norm2": "norm1", "attn.proj": "wo", "mlp.fc1": "mlp.fc0",
                 "mlp.fc2": "mlp.fc1"}
_RELEASED_BLOCK = re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.(norm0|norm1|wqkv|wo|mlp\.fc0|mlp\.fc1)\."
                             r"(weight|bias)$")
_NATIVE_QKV = re.compile(r"^native\.blocks\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$")
_NATIVE_OTHER = re.compile(r"^native\.blocks\.(\d+)\.(norm1|norm2|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)$")


def is_vision_name(name: str) -> bool:
  return name.startswith(("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector."))


def _released_name(name: str) -> str:
  for prefix, repl in _PREFIXES:
    if name.startswith(prefix):
      name = repl + name[len(prefix):]
      break
  m = _NATIVE_OTHER.match(name)
  if m:
    name = f"vision_tower.encoder.blocks.{m.group(1)}.{_NATIVE_BLOCK[m.group(2)]}.{m.group(3)}"
  return name


# ------------------------------------------------------------------- name ⇄ param
def vision_target(name: str):
  """A released (or normalised) tensor name → (our param path, transform) or None."""
  if name in ("vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.proj.bias"):
    kind = "conv" if name.endswith("weight") else "copy"
    return (VISION, "patch_embed", "proj", "kernel" if kind == "conv" else "bias"), kind
  if name == "vision_tower.patch_embed.pos_emb.weight":
    return (VISION, "patch_embed", "pos_emb", "weight"), "copy"
  if name.startswith("vision_tower.encoder.final_layernorm."):
    return (VISION, "encoder", "final_layernorm", name.rsplit(".", 1)[1]), "copy"
  m = _RELEASED_BLOCK.match(name)
  if m:
    i, module, leaf = m.groups()
    path = (VISION, "encoder", f"blocks_{i}") + tuple(module.split("."))
    if module.startswith("norm"):
      return path + (leaf,), "copy"
    if leaf == "bias":
      return path + ("bias",), {"wqkv": "qkv_bias"}.get(module, "copy")
    return path + ("kernel",), {"wqkv": "qkv", "wo": "wo"}.get(module, "t")
  if name.startswith("mm_projector.pre_norm."):
    return (PROJECTOR, "pre_norm", name.rsplit(".", 1)[1]), "copy"
  m = re.match(r"^mm_projector\.proj\.([02])\.(weight|bias)$", name)
  if m:
    leaf = "kernel" if m.group(2) == "weight" else "bias"
    return (PROJECTOR, f"proj_{m.group(1)}", leaf), "t" if leaf == "kernel" else "copy"
  return None


def _to_ours(kind: str, x: np.ndarray, vcfg: VisionConfig) -> np.ndarray:
  d, heads, head_dim = vcfg.hidden_size, vcfg.num_attention_heads, vcfg.head_dim
  if kind == "copy":
    return x
  if kind == "t":
    return x.T
  if kind == "conv":                       # [D, 3, p, p] → [3·p·p, D]
    return x.reshape(x.shape[0], -1).T
  if kind == "qkv":                        # [3·D, D] → [D, 3, H, hd]
    return x.T.reshape(x.shape[1], 3, heads, head_dim)
  if kind == "qkv_bias":                   # [3·D] → [3, H, hd]
    return x.reshape(3, heads, head_dim)
  if kind == "wo":                         # [D, H·hd] → [H, hd, D]
    return x.T.reshape(heads, head_dim, d)
  raise ValueError(kind)


def _from_ours(kind: str, x: np.ndarray) -> np.ndarray:
  if kind == "copy":
    return x
  if kind == "t":
    return x.T
  if kind == "conv":                       # [3·p·p, D] → [D, 3, p, p]
    p = int(round((x.shape[0] // 3) ** 0.5))
    return x.T.reshape(x.shape[1], 3, p, p)
  if kind == "qkv":                        # [D, 3, H, hd] → [3·D, D]
    return x.reshape(x.shape[0], -1).T
  if kind == "qkv_bias":
    return x.reshape(-1)
  if kind == "wo":                         # [H, hd, D] → [D, H·hd]
    return x.reshape(-1, x.shape[-1]).T
  raise ValueError(kind)


def unpermute_rope_rows(x: np.ndarray, heads: int) -> np.ndarray:
  """Rows of a q/k projection from rotate-half order (r·d/2 + k per head) to adjacent pairs (2k + r)."""
  half = x.shape[0] // heads // 2
  return x.reshape(heads, 2, half, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def released_names(key: tuple) -> str:
  """Our vision/projector param path → its released tensor name."""
  if key[0] == PROJECTOR:
    if key[1] == "pre_norm":
      return f"mm_projector.pre_norm.{key[2]}"
    return f"mm_projector.proj.{key[1][-1]}.{'weight' if key[2] == 'kernel' else 'bias'}"
  if key[1] == "patch_embed":
    if key[2] == "pos_emb":
      return "vision_tower.patch_embed.pos_emb.weight"
    return f"vision_tower.patch_embed.proj.{'weight' if key[3] == 'kernel' else 'bias'}"
  if key[2] == "final_layernorm":
    return f"vision_tower.encoder.final_layernorm.{key[3]}"
  i = key[2].split("_")[1]
  leaf = {"kernel": "weight"}.get(key[-1], key[-1])
  return f"vision_tower.encoder.blocks.{i}.{'.'.join(key[3:-1])}.{leaf}"


# -------------------------------------------------------------------------- load
def _stored_shape(kind: str, ours: tuple, vcfg: VisionConfig) -> tuple:
  """The checkpoint's layout of a param of shape `ours` stored as `kind` (`_from_ours`'s shapes)."""
  if kind == "t":
    return tuple(ours[::-1])
  if kind == "conv":                       # [3·p·p, D] ← [D, 3, p, p]
    return (ours[1], 3, vcfg.patch_size, vcfg.patch_size)
  if kind == "qkv":                        # [D, 3, H, hd] ← [3·D, D]
    return (ours[1] * ours[2] * ours[3], ours[0])
  if kind == "qkv_bias":                   # [3, H, hd] ← [3·D]
    return (ours[0] * ours[1] * ours[2],)
  if kind == "wo":                         # [H, hd, D] ← [D, H·hd]
    return (ours[2], ours[0] * ours[1])
  return tuple(ours)


def reader(cfg: K25Config, shardings: Any = None, folder: str | None = None):
  """The vision tower and projector of a K2.5 folder, read in the text model's pass over its files.

  Returns (consume, finish): consume(raw_name, file) is the `consume` hook of
  `hf.load_text_params` (True for a vision or projector tensor, taken here); finish(text)
  checks that every vision tensor came and returns the {"language_model", "vision_tower",
  "mm_projector"} params with `text` as the language model's. Errors are CheckpointErrors
  naming the file and tensor (`folder`, the checkpoint's, for a tensor that is missing).
  """
  vcfg = cfg.vision
  abstract = traverse_util.flatten_dict(nn.meta.unbox(k25.abstract_params(cfg)))
  expected = {key: tuple(v.shape) for key, v in abstract.items() if key[0] != TEXT}
  flat_shardings = traverse_util.flatten_dict(shardings) if shardings is not None else {}
  param_dtype = dtype_of(vcfg.param_dtype)
  out: dict[tuple, Any] = {}
  source_of: dict[tuple, str] = {}
  qkv_parts: dict[tuple, dict[str, tuple[np.ndarray, str]]] = {}   # key → q/k/v → (rows, where)

  def place(key: tuple, value: np.ndarray, where: str):
    if tuple(value.shape) != expected[key]:   # the stored shape was checked: a bug here, not in the file
      raise CheckpointError(f"{where} gives shape {tuple(value.shape)} for "
                            f"{'/'.join(key)}, which this config makes {expected[key]}")
    if key in out:
      raise CheckpointError(f"{where} duplicates {source_of[key]}")
    source_of[key] = where
    arr = np.asarray(value).astype(param_dtype)
    out[key] = jax.device_put(arr, flat_shardings[key]) if key in flat_shardings else jax.numpy.asarray(arr)

  def place_native_qkv(name: str, value: np.ndarray, where: str):
    i, which, leaf = _NATIVE_QKV.match(name).groups()
    key = (VISION, "encoder", f"blocks_{i}", "wqkv", "kernel" if leaf == "weight" else "bias")
    if key not in expected:
      raise CheckpointError(f"{where} has no place in a model with this config")
    fused = _stored_shape("qkv" if leaf == "weight" else "qkv_bias", expected[key], vcfg)
    want = (fused[0] // 3,) + fused[1:]
    if value.shape != want:
      raise shape_error(where, value.shape, want, key + (which,), expected[key])
    if key in out:
      raise CheckpointError(f"{where} duplicates {source_of[key]}")
    parts = qkv_parts.setdefault(key, {})
    if which in parts:
      raise CheckpointError(f"{where} duplicates {parts[which][1]}")
    if which in "qk":
      value = unpermute_rope_rows(value, vcfg.num_attention_heads)
    parts[which] = (value, where)
    if len(parts) == 3:
      fused = np.concatenate([parts[c][0] for c in "qkv"], axis=0)
      del qkv_parts[key]
      place(key, _to_ours("qkv" if leaf == "weight" else "qkv_bias", fused, vcfg),
            f"{where} (with its q/k projections)")

  def consume(raw_name: str, file) -> bool:
    if not is_vision_name(raw_name):
      return False
    where = at(file.path, raw_name)
    name = _released_name(raw_name)
    native = _NATIVE_QKV.match(name)
    target = None if native else vision_target(name)
    if not native and (target is None or target[0] not in expected):
      raise CheckpointError(f"{where} has no place in a model with this config")
    require_dtype(file, raw_name, FLOAT)
    value = file.get(raw_name)
    if native:
      place_native_qkv(name, value, where)
      return True
    key, kind = target
    want = _stored_shape(kind, expected[key], vcfg)
    if value.shape != want:
      raise shape_error(where, value.shape, want, key, expected[key])
    place(key, _to_ours(kind, value, vcfg), where)
    return True

  def finish(text):
    prefix = f"{folder}: " if folder is not None else ""
    if qkv_parts:
      key, parts = next(iter(qkv_parts.items()))
      found = "; ".join(where for _, where in parts.values())
      raise CheckpointError(f"{found}: only {sorted(parts)} of the q/k/v projections of {'/'.join(key)} "
                            "are present")
    for key in expected:
      if key not in out:
        raise CheckpointError(f"{prefix}missing tensor {released_names(key)!r} (for {'/'.join(key)})")
    params = traverse_util.unflatten_dict(out)
    params[TEXT] = text
    return params

  return consume, finish


# -------------------------------------------------------------------------- save
def to_hf_tensors(params) -> Iterator[tuple[str, np.ndarray]]:
  """(released name, array) for every vision tower and projector param of K25 `params`."""
  for part in (VISION, PROJECTOR):
    for key, value in traverse_util.flatten_dict(params[part]).items():
      key = (part,) + key
      name = released_names(key)
      _, kind = vision_target(name)
      yield name, np.ascontiguousarray(_from_ours(kind, np.asarray(jax.device_get(value))))
