"""Hugging Face checkpoints ⇄ k25jax params for the K2 text backbone.

    cfg, params = hf.load(path)          # config.json + safetensors (sharded index too)
    hf.save(cfg, params, path)           # a folder `DeepseekV3ForCausalLM.from_pretrained` loads

A K2.5 folder whose config.json has a `vision_config` loads as the multimodal model
(`K25Config`, params with the vision tower and projector) unless `text_only=True`;
`hf.save` of a `K25Config` writes the multimodal checkpoint. The vision tower and
projector tensors are `k25jax.convert.hf_vision`'s, read and written here beside the
text model's.

Names understood on load:
* per-expert tensors `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`;
* transformers 5.x fused experts `mlp.experts.gate_up_proj` [E, 2f, d] and `mlp.experts.down_proj` [E, d, f];
* the K2.5 multimodal prefixes `language_model.model.` / `language_model.lm_head.` (released files)
  and `model.language_model.` (transformers' layout; `language_model.model.blocks.` as its
  save_pretrained writes them); vision tensors are skipped here;
* routed experts in INT4 pack-quantized form (`weight_packed`, `weight_scale`, `weight_shape`),
  dequantized on load (`k25jax.convert.int4`).

Loading checks every tensor from the files' headers first, then reads each param onto its
sharding a device's slice at a time (`k25jax.convert.lazy`): a process holds one device's
slice of a leaf plus the tensor being read, and reads only the experts its devices hold.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
from absl import logging
from flax import traverse_util

from k25jax.convert import fp8, hf_vision, int4, lazy, safetensors_io, scan
from k25jax.convert.common import FLOAT, INTEGER, CheckpointError, at, require_dtype, shape_error
from k25jax.model import transformer
from k25jax.model.config import K25Config, ModelConfig
from k25jax.model.layers import dtype_of

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_ROUTED_EXPERT_WEIGHT = re.compile(r"\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_QUANT_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
_SKIPPED = re.compile(r"(rotary_emb\.inv_freq$|^vision_tower\.|^mm_projector\.|^model\.vision_tower\.|"
                      r"^model\.mm_projector\.|^multi_modal_projector\.)")


# ------------------------------------------------------------------------ naming
def normalize_name(name: str) -> str:
  """Maps the multimodal prefixes onto the text model's `model.` / `lm_head.` names."""
  for prefix, repl in (("language_model.model.blocks.", "model.layers."),
                       ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                       ("model.language_model.", "model.")):
    if name.startswith(prefix):
      return repl + name[len(prefix):]
  return name


def _attn_rule(cfg: ModelConfig, proj: str):
  h = cfg.num_attention_heads
  return {
      "q_a_proj": ("t", None), "q_b_proj": ("t_heads_out", h), "q_proj": ("t_heads_out", h),
      "kv_a_proj_with_mqa": ("t", None), "kv_b_proj": ("t_heads_out", h), "o_proj": ("t_heads_in", h),
  }.get(proj)


def hf_target(cfg: ModelConfig, name: str):
  """HF tensor name → (our param path, transform, expert index) or None if not ours."""
  if name == "model.embed_tokens.weight":
    return ("embed_tokens", "embedding"), "copy", None
  if name == "lm_head.weight":
    return ("lm_head",), "t", None
  if name == "model.norm.weight":
    return ("norm", "weight"), "copy", None
  m = _LAYER.match(name)
  if not m:
    return None
  i, rest = int(m.group(1)), m.group(2)
  if i >= cfg.num_hidden_layers:
    return None  # multi-token-prediction layers of DeepSeek-style checkpoints
  layer = f"layers_{i}"
  parts = rest.split(".")
  if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
    return (layer, parts[0], "weight"), "copy", None
  if parts[0] == "self_attn":
    if len(parts) != 3:
      return None
    if parts[1] in ("q_a_layernorm", "kv_a_layernorm") and parts[2] == "weight":
      return (layer, "self_attn", parts[1], "weight"), "copy", None
    rule = _attn_rule(cfg, parts[1])
    if rule and parts[2] == "weight":
      return (layer, "self_attn", parts[1], "kernel"), rule[0], None
    if rule and parts[2] == "bias":
      return (layer, "self_attn", parts[1], "bias"), "copy", None
    return None
  if parts[0] != "mlp":
    return None
  if not cfg.is_moe_layer(i):
    if len(parts) == 3 and parts[1] in ("gate_proj", "up_proj", "down_proj") and parts[2] == "weight":
      return (layer, "mlp", parts[1], "kernel"), "t", None
    return None
  if rest == "mlp.gate.weight":
    return (layer, "mlp", "gate", "kernel"), "t", None
  if rest == "mlp.gate.e_score_correction_bias":
    return (layer, "mlp", "gate", "e_score_correction_bias"), "copy", None
  if len(parts) == 4 and parts[1] == "shared_experts" and parts[3] == "weight":
    return (layer, "mlp", "shared_experts", parts[2], "kernel"), "t", None
  e = _EXPERT.match(rest)
  if e:
    return (layer, "mlp", "experts", e.group(2)), "t", int(e.group(1))
  if rest == "mlp.experts.gate_up_proj":
    return (layer, "mlp", "experts"), "fused_gate_up", None
  if rest == "mlp.experts.down_proj":
    return (layer, "mlp", "experts", "down_proj"), "fused_down", None
  return None


def _transform(kind: str, x: np.ndarray, heads: int | None = None) -> np.ndarray:
  if kind == "copy":
    return x
  if kind == "t":
    return x.T
  if kind == "t_heads_out":   # [heads·k, in] → [in, heads, k]
    return x.T.reshape(x.shape[1], heads, -1)
  if kind == "t_heads_in":    # [out, heads·k] → [heads, k, out]
    return x.T.reshape(heads, -1, x.shape[0])
  if kind == "fused_down":    # [E, d, f] → [E, f, d]
    return np.swapaxes(x, 1, 2)
  raise ValueError(kind)


# -------------------------------------------------------------------------- load
def _stored_shape(kind: str, ours: tuple) -> tuple:
  """The checkpoint's layout of a param of shape `ours` stored as `kind` (`_transform`'s inverse)."""
  if kind == "t":
    return tuple(ours[::-1])
  if kind == "t_heads_out":   # [in, heads, k] ← [heads·k, in]
    return (ours[1] * ours[2], ours[0])
  if kind == "t_heads_in":    # [heads, k, out] ← [out, heads·k]
    return (ours[2], ours[0] * ours[1])
  if kind == "fused_down":    # [E, f, d] ← [E, d, f]
    return (ours[0], ours[2], ours[1])
  return tuple(ours)


def read_config(path: str) -> dict:
  """config.json of the folder as a dict; a file that is not a JSON object is a CheckpointError."""
  file = os.path.join(path, "config.json")
  with open(file, "rb") as f:
    raw = f.read()
  try:
    hf_cfg = json.loads(raw.decode("utf-8"))
  except ValueError as e:   # UnicodeDecodeError, JSONDecodeError
    raise CheckpointError(f"{file} is not valid JSON ({e})") from None
  if not isinstance(hf_cfg, dict):
    raise CheckpointError(f"{file} holds a JSON {type(hf_cfg).__name__}, not an object")
  return hf_cfg


def _config_from(path: str, build: Callable[..., Any], hf_cfg: dict, overrides: dict):
  """build(hf_cfg, **overrides), its failure a CheckpointError naming config.json."""
  try:
    return build(hf_cfg, **overrides)
  except (ValueError, TypeError, KeyError, AttributeError) as e:
    extra = f" (with overrides {overrides})" if overrides else ""
    raise CheckpointError(f"{os.path.join(path, 'config.json')}{extra} does not make a valid config: "
                          f"{type(e).__name__}: {e}") from e


def load_config(path: str, **overrides: Any) -> ModelConfig:
  return _config_from(path, ModelConfig.from_hf_dict, read_config(path), overrides)


def _quant_groups(hf_cfg: dict) -> list:
  qc = hf_cfg.get("quantization_config") or (hf_cfg.get("text_config") or {}).get("quantization_config") or {}
  return [group.get("weights") or {} for group in (qc.get("config_groups") or {}).values()]


def _quant_group(hf_cfg: dict) -> int:
  """The INT4 group size of a compressed-tensors `quantization_config` (32 if absent)."""
  for weights in _quant_groups(hf_cfg):
    size = weights.get("group_size")
    if size:
      return int(size)
  return 32


def _quant_settings(path: str, hf_cfg: dict) -> tuple[int, bool]:
  """(group size, whether zero points are stored) of config.json's `quantization_config`."""
  try:
    group = _quant_group(hf_cfg)
    asymmetric = any(weights.get("symmetric", True) is False for weights in _quant_groups(hf_cfg))
  except (AttributeError, TypeError, ValueError) as e:
    raise CheckpointError(f"{os.path.join(path, 'config.json')}: its quantization_config is malformed "
                          f"({type(e).__name__}: {e})") from e
  if group <= 0:
    raise CheckpointError(f"{os.path.join(path, 'config.json')}: quantization group_size {group} is not positive")
  return group, asymmetric


# The dtypes each part of an INT4 pack-quantized weight may be stored in (`k25jax.convert.int4`).
_QUANT_DTYPES = {
    "weight_packed": (("I32",), "an INT4 weight_packed (8 values per int32)"),
    "weight_scale": (FLOAT, "an INT4 weight_scale"),
    "weight_shape": (INTEGER, "an INT4 weight_shape"),
    "weight_zero_point": (INTEGER + FLOAT, "an INT4 weight_zero_point"),
}


def _skipped(cfg: ModelConfig, name: str) -> bool:
  """Tensors of a checkpoint that are not ours to load (vision in a text-only load, MTP layers)."""
  layer = _LAYER.match(name)
  return bool(_SKIPPED.search(name)) or bool(layer and int(layer.group(1)) >= cfg.num_hidden_layers)


def load(path: str, shardings: Any = None, *, text_only: bool = False, **overrides: Any):
  """Reads a HF checkpoint folder → (ModelConfig, params pytree).

  overrides: our ModelConfig fields (e.g. moe_impl="dense", param_dtype="bfloat16").
  shardings: optional pytree of `jax.sharding.Sharding` with the params' structure.
  A K2.5 folder with a `vision_config` gives (K25Config, multimodal params) unless text_only.

  A malformed folder raises `CheckpointError` (a ValueError) naming the file and the tensor:
  a config.json or safetensors file that does not parse, a tensor of a dtype that cannot
  hold it (nothing is cast but float → float), of a shape the config does not give it,
  missing, duplicated or with no place. A missing file is a FileNotFoundError.
  """
  hf_cfg = read_config(path)
  if "vision_config" in hf_cfg and not text_only:
    cfg = _config_from(path, K25Config.from_hf_dict, hf_cfg, overrides)
    consume, finish = hf_vision.reader(cfg, shardings, folder=path)
    text_shardings = None if shardings is None else shardings[hf_vision.TEXT]
    return cfg, finish(load_text_params(path, hf_cfg, cfg.text, text_shardings, consume=consume))
  cfg = _config_from(path, ModelConfig.from_hf_dict, hf_cfg, overrides)
  return cfg, load_text_params(path, hf_cfg, cfg, shardings)


def load_text_params(path: str, hf_cfg: dict, cfg: ModelConfig, shardings: Any = None,
                     consume: Callable[[str, Any], bool] | None = None):
  """The text backbone's params from the folder's safetensors.

  The pass over the files checks every tensor's name, dtype and shape from the headers and
  makes each param a `lazy.Leaf`; the params are then read onto their shardings a device's
  slice at a time (`lazy.materialize`), so that no stacked leaf is ever whole on the host.
  consume(raw_name, file): called first for every tensor; True means it took the tensor
  (the vision loader's hook), so it is not placed here.
  """
  per_layer = cfg.replace(scan_layers=False)   # read per layer; stacked (lazily) at the end if cfg.scan_layers
  expected = {k: tuple(v.shape) for k, v in
              traverse_util.flatten_dict(nn.meta.unbox(transformer.abstract_params(per_layer))).items()}
  param_dtype = dtype_of(cfg.param_dtype)
  leaves: dict[tuple, lazy.Leaf] = {}
  filled: dict[tuple, dict[int, tuple[lazy.Tensor, str]]] = {}   # stacked experts so far → (tensor, where)
  quant_parts: dict[str, dict[str, tuple[Any, str]]] = {}   # module → part → (file, raw name)
  group, asymmetric = _quant_settings(path, hf_cfg)
  needed_parts = _QUANT_PARTS if asymmetric else _QUANT_PARTS[:3]
  try:
    fp8_block = fp8.block_size(hf_cfg)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{os.path.join(path, 'config.json')}: its FP8 quantization_config is malformed ({e})") from e
  fp8_parts: dict[str, dict[str, tuple[Any, str]]] = {}   # module → weight / scale → (file, raw name)
  skipped_layers: set[int] = set()
  source_of: dict[tuple, str] = {}

  def no_place(where: str) -> CheckpointError:
    return CheckpointError(f"{where} has no place in a model with this config")

  def place(name: str, tensor: lazy.Tensor, where: str):
    """`tensor`, HF tensor `name` (read from `where`, see common.at), as its param."""
    key, kind, expert = hf_target(cfg, name)
    if kind == "fused_gate_up":
      gate, up = key + ("gate_proj",), key + ("up_proj",)
      if gate not in expected:
        raise no_place(where)
      n, d, f = expected[gate]
      if tensor.shape != (n, 2 * f, d):
        raise shape_error(where, tensor.shape, (n, 2 * f, d), key + ("gate_proj+up_proj",), (n, d, 2 * f))
      place_leaf(gate, lazy.single((n, d, f), tensor, lambda x: np.swapaxes(x[:, :f], 1, 2)), where)
      place_leaf(up, lazy.single((n, d, f), tensor, lambda x: np.swapaxes(x[:, f:], 1, 2)), where)
      return
    if key not in expected:
      raise no_place(where)
    full = expected[key]
    if expert is not None:
      if expert >= full[0]:
        raise CheckpointError(f"{where}: expert {expert} but config has n_routed_experts={full[0]}")
      if tensor.shape != _stored_shape(kind, full[1:]):
        raise shape_error(where, tensor.shape, _stored_shape(kind, full[1:]), key + (str(expert),), full[1:])
      if key in leaves:
        raise CheckpointError(f"{where} duplicates {source_of[key]}")
      if expert in filled.get(key, {}):
        raise CheckpointError(f"{where} duplicates {filled[key][expert][1]}")
      filled.setdefault(key, {})[expert] = (tensor, where)
      if len(filled[key]) == full[0]:
        source_of[key] = f"the per-expert tensors (the last {where})"
        tensors = [t for _, (t, _) in sorted(filled.pop(key).items())]
        leaves[key] = lazy.experts(full, tensors, lambda x: _transform(kind, x))
      return
    if tensor.shape != _stored_shape(kind, full):
      raise shape_error(where, tensor.shape, _stored_shape(kind, full), key, full)
    place_leaf(key, lazy.single(full, tensor, lambda x: _transform(kind, x, cfg.num_attention_heads)), where)

  def place_leaf(key: tuple, leaf: lazy.Leaf, where: str):
    if key in leaves or key in filled:
      raise CheckpointError(f"{where} duplicates {source_of.get(key) or 'the per-expert tensors'}")
    source_of[key] = where
    leaves[key] = leaf

  def stored(file, raw_name: str) -> lazy.Tensor:
    return lazy.Tensor(file.shape(raw_name), lambda: file.get(raw_name))

  def checked(read: Callable[[], np.ndarray], where: str) -> Callable[[], np.ndarray]:
    """`read` whose ValueError (a dequantization's) is a CheckpointError naming `where`."""
    def run():
      try:
        return read()
      except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return run

  def quantized_at(module: str, parts: dict[str, tuple[Any, str]]) -> str:
    files = ", ".join(sorted({file.path for file, _ in parts.values()}))
    return f"{at(files, module + '.weight_*')} (INT4-quantized)"

  def place_quantized(module: str, parts: dict[str, tuple[Any, str]]):
    where = quantized_at(module, parts)
    read = {part: (lambda f=file, n=name: f.get(n)) for part, (file, name) in parts.items()}
    header = {part: file.shape(name) for part, (file, name) in parts.items()}
    try:           # the parts' shapes from the headers; the values are read when the param is
      shape = int4.check(header["weight_packed"], header["weight_scale"], read["weight_shape"](), group)
    except ValueError as e:
      raise CheckpointError(f"{where}: {e}") from None
    zero = read.get("weight_zero_point")
    dequantized = lambda: int4.dequantize(read["weight_packed"](), read["weight_scale"](), shape,
                                          None if zero is None else zero(), group)
    place(module + ".weight", lazy.Tensor(shape, checked(dequantized, where)), where)

  def place_fp8(module: str, parts: dict[str, tuple[Any, str]]):
    (file, name), (scale_file, scale_name) = parts["weight"], parts[fp8.SCALE]
    where = at(file.path, module + ".weight") + " (FP8, block-scaled)"
    dequantized = lambda: fp8.dequantize(file.get(name), scale_file.get(scale_name), fp8_block)
    place(module + ".weight", lazy.Tensor(file.shape(name), checked(dequantized, where)), where)

  for raw_name, file in safetensors_io.iterate(path):
    if consume is not None and consume(raw_name, file):
      continue
    name = normalize_name(raw_name)
    where = at(file.path, raw_name)
    module, _, leaf = name.rpartition(".")
    quantized = leaf in _QUANT_PARTS
    target_name = module + ".weight" if quantized or leaf == fp8.SCALE else name
    if hf_target(cfg, target_name) is None:
      if _skipped(cfg, target_name):
        layer = _LAYER.match(target_name)
        if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
          skipped_layers.add(int(layer.group(1)))
        continue
      raise no_place(where)
    if leaf == fp8.SCALE and fp8_block is None:
      raise CheckpointError(f"{where}: an FP8 block scale, but config.json has no quantization_config with "
                            f"quant_method 'fp8'")
    if fp8_block is not None and (leaf == fp8.SCALE or (leaf == "weight" and file.dtype(raw_name) == "F8_E4M3")):
      require_dtype(file, raw_name, ("F32", "BF16", "F16") if leaf == fp8.SCALE else ("F8_E4M3",),
                    f"an FP8 {leaf}")
      parts = fp8_parts.setdefault(module, {})
      if leaf in parts:
        raise CheckpointError(f"{where} duplicates {at(parts[leaf][0].path, raw_name)}")
      parts[leaf] = (file, raw_name)
      if len(parts) == 2:
        place_fp8(module, fp8_parts.pop(module))
      continue
    if not quantized:
      require_dtype(file, raw_name, FLOAT)
      place(name, stored(file, raw_name), where)
      continue
    require_dtype(file, raw_name, *_QUANT_DTYPES[leaf])
    parts = quant_parts.setdefault(module, {})
    if leaf in parts:
      raise CheckpointError(f"{where} duplicates {at(parts[leaf][0].path, raw_name)}")
    parts[leaf] = (file, raw_name)
    if all(p in parts for p in needed_parts):
      del quant_parts[module]
      place_quantized(module, parts)

  if fp8_parts:
    module, parts = next(iter(fp8_parts.items()))
    have, = parts
    raise CheckpointError(f"{at(parts[have][0].path, module + '.' + have)} (FP8) has no "
                          f"{'weight_scale_inv' if have == 'weight' else 'weight'} beside it")
  if skipped_layers:
    logging.info("%s: skipped layers %s: multi-token-prediction layers (num_nextn_predict_layers=%s), "
                 "which k25jax does not train", path, sorted(skipped_layers), hf_cfg.get("num_nextn_predict_layers"))
  if quant_parts:
    module, parts = next(iter(quant_parts.items()))
    raise CheckpointError(f"{quantized_at(module, parts)} is incomplete: has {sorted(parts)}, needs "
                          f"{list(needed_parts)}")
  for key in filled:
    missing = sorted(set(range(expected[key][0])) - set(filled[key]))
    raise CheckpointError(f"{path}: missing tensor {_hf_expert_name(key, missing[0])!r} (experts {missing})")
  for key in expected:
    if key not in leaves:
      raise CheckpointError(f"{path}: missing tensor for {'/'.join(key)} (HF name {hf_names(cfg, key)[0]!r})")
  layout = traverse_util.flatten_dict(scan.to_layout(cfg, traverse_util.unflatten_dict(leaves), stack=lazy.stacked))
  flat_shardings = traverse_util.flatten_dict(shardings) if shardings is not None else {}
  out = {}
  for key, leaf in layout.items():
    dtype = np.float32 if key[-1] in ("e_score_correction_bias",) or key[-2:] == ("gate", "kernel") else param_dtype
    out[key] = lazy.materialize(leaf, dtype, flat_shardings.get(key))
  return traverse_util.unflatten_dict(out)


def _hf_expert_name(key: tuple, expert: int) -> str:
  return f"model.layers.{key[0].split('_')[1]}.mlp.experts.{expert}.{key[-1]}.weight"


# -------------------------------------------------------------------------- save
def hf_names(cfg: ModelConfig, key: tuple) -> list[str]:
  """The HF names a param leaf is written as (one per expert for stacked experts)."""
  if key == ("embed_tokens", "embedding"):
    return ["model.embed_tokens.weight"]
  if key == ("lm_head",):
    return ["lm_head.weight"]
  if key == ("norm", "weight"):
    return ["model.norm.weight"]
  i = int(key[0].split("_")[1])
  base = f"model.layers.{i}." + ".".join(k for k in key[1:-1])
  if key[1:3] == ("mlp", "experts"):
    return [f"model.layers.{i}.mlp.experts.{e}.{key[3]}.weight" for e in range(cfg.n_routed_experts)]
  if key[-1] == "e_score_correction_bias":
    return [f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
  suffix = "bias" if key[-1] == "bias" else "weight"
  return [f"{base}.{suffix}"]


def to_hf_tensors(cfg: ModelConfig, params) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (HF name, numpy array) for every param, experts split per expert (scanned
  params are unstacked into their layers first)."""
  if scan.is_scanned(params):
    params = scan.unstack_layers(cfg, params)
  flat = traverse_util.flatten_dict(params)
  for key, value in flat.items():
    value = np.asarray(jax.device_get(value))
    names = hf_names(cfg, key)
    if key[1:3] == ("mlp", "experts"):
      for e, name in enumerate(names):
        yield name, np.ascontiguousarray(value[e].T)
      continue
    if value.ndim == 3 and key[-1] == "kernel":       # per-head projections
      if key[-2] == "o_proj":                          # [heads, k, out] → [out, heads·k]
        value = value.reshape(-1, value.shape[-1]).T
      else:                                            # [in, heads, k] → [heads·k, in]
        value = value.reshape(value.shape[0], -1).T
    elif value.ndim == 2 and key != ("embed_tokens", "embedding"):
      value = value.T
    yield names[0], np.ascontiguousarray(value)


def save(cfg: ModelConfig, params, path: str, max_shard_bytes: int = 2 << 30, int4_group: int | None = None) -> None:
  """Writes config.json + safetensors shards (+ index when sharded) that transformers loads.

  A `K25Config` writes the multimodal checkpoint (transformers' Kimi_K25Config, the
  released tensor layout): the text model under `language_model.`, then the vision
  tower and projector (`hf_vision.to_hf_tensors`). `int4_group`: the routed experts
  pack-quantized in groups of that many input columns, bfloat16 scales, as released
  (`int4.quantization_config`); everything else as given.
  """
  if not isinstance(cfg, ModelConfig):
    text = ((f"{hf_vision.TEXT}.{name}", value)
            for name, value in to_hf_tensors(cfg.text, params[hf_vision.TEXT]))
    tensors, hf_config = itertools.chain(text, hf_vision.to_hf_tensors(params)), cfg.to_hf_dict()
  else:
    tensors, hf_config = to_hf_tensors(cfg, params), cfg.to_hf_dict()
  if int4_group:
    tensors = _int4_experts(tensors, int4_group)
    hf_config["quantization_config"] = int4.quantization_config(int4_group)
  write_checkpoint(path, hf_config, tensors, max_shard_bytes)


def _int4_experts(tensors: Iterator[tuple[str, np.ndarray]], group: int) -> Iterator[tuple[str, np.ndarray]]:
  """The stream with every routed expert's `.weight` as `weight_packed`, `weight_scale`
  (bfloat16) and `weight_shape` (`int4.quantize`)."""
  for name, value in tensors:
    if not _ROUTED_EXPERT_WEIGHT.search(name):
      yield name, value
      continue
    try:
      packed, scale = int4.quantize(value, group, scale_dtype=ml_dtypes.bfloat16)
    except ValueError as e:
      raise ValueError(f"{name}: {e}") from e
    stem = name[:-len("weight")]
    yield stem + "weight_packed", packed
    yield stem + "weight_scale", scale
    yield stem + "weight_shape", np.asarray(value.shape, np.int64)


def write_checkpoint(path: str, hf_config: dict, tensors: Iterator[tuple[str, np.ndarray]],
                     max_shard_bytes: int = 2 << 30) -> None:
  """config.json + the (name, array) stream as safetensors shards (+ index when sharded)."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  shards, current, size = [], {}, 0
  for name, value in tensors:
    if current and size + value.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = value
    size += value.nbytes
  shards.append(current)
  if len(shards) == 1:
    safetensors_io.write(os.path.join(path, "model.safetensors"), shards[0], {"format": "pt"})
    return
  weight_map = {}
  for n, shard in enumerate(shards):
    fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
    safetensors_io.write(os.path.join(path, fname), shard, {"format": "pt"})
    weight_map.update({name: fname for name in shard})
  total = sum(v.nbytes for s in shards for v in s.values())
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
