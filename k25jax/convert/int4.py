"""Pack-quantized INT4 weights (compressed-tensors `pack-quantized`, symmetric, grouped).

The released K2.5 routed experts store each [out, in] matrix W as
* `weight_packed` int32 [out, ceil(in/8)]: q + 8 as nibbles, element i of a word at bits 4i;
* `weight_scale` [out, in/group] (bf16), `weight_shape` = [out, in],
  optionally `weight_zero_point` (asymmetric variants: int32 packed along the rows,
  [ceil(out/8), in/group], or unpacked [out, in/group]);
and W ≈ (q − z) · s with q ∈ [−8, 7] per group of `group` (32) input columns.
Quantization (the published formula): s = max|W_g| / 7.5, q = clip(round(W/s), −8, 7).
"""
from __future__ import annotations

import numpy as np

BITS = 4
PER_WORD = 32 // BITS


def unpack(packed: np.ndarray, columns: int) -> np.ndarray:
  """int32 [..., words] → int8 [..., columns] in [−8, 7]."""
  words = np.ascontiguousarray(packed.astype("<i4"))
  nibbles = words.view(np.uint8)
  values = np.stack([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
  return (values[..., :columns].astype(np.int8) - 8)


def pack(q: np.ndarray) -> np.ndarray:
  """int values in [−8, 7], [..., columns] → int32 [..., ceil(columns/8)]."""
  if q.min() < -8 or q.max() > 7:
    raise ValueError("int4 values must lie in [-8, 7]")
  columns = q.shape[-1]
  padded = -(-columns // PER_WORD) * PER_WORD
  u = np.zeros((*q.shape[:-1], padded), np.uint32)
  u[..., :columns] = (q.astype(np.int32) + 8).astype(np.uint32)
  u = u.reshape(*q.shape[:-1], -1, PER_WORD)
  shifts = (np.arange(PER_WORD, dtype=np.uint32) * BITS)
  return np.bitwise_or.reduce(u << shifts, axis=-1).astype(np.uint32).view(np.int32)


def check(packed_shape, scale_shape, shape, group: int) -> tuple[int, int]:
  """(out, in) of an INT4 weight whose parts have these shapes (`shape`: the weight_shape
  values); parts that disagree with it raise a ValueError (the caller names the tensors)."""
  dims = np.asarray(shape)
  if (dims.shape != (2,) or not np.issubdtype(dims.dtype, np.integer) or (dims <= 0).any()):
    raise ValueError(f"int4 weight_shape {dims.tolist()!r:.100} is not [out, in] with positive integers")
  if not isinstance(group, (int, np.integer)) or group <= 0:
    raise ValueError(f"int4 group size {group!r} is not a positive integer")
  out_dim, in_dim = (int(s) for s in dims)
  if tuple(packed_shape) != (out_dim, -(-in_dim // PER_WORD)):
    raise ValueError(f"int4 packed shape {tuple(packed_shape)} does not match weight shape {(out_dim, in_dim)} "
                     f"(needs {(out_dim, -(-in_dim // PER_WORD))}, {PER_WORD} values per int32)")
  if tuple(scale_shape) != (out_dim, -(-in_dim // group)):
    raise ValueError(f"int4 scale shape {tuple(scale_shape)} does not match weight shape {(out_dim, in_dim)} "
                     f"with group size {group}")
  return out_dim, in_dim


def dequantize(packed: np.ndarray, scale: np.ndarray, shape, zero_point: np.ndarray | None = None,
               group: int = 32) -> np.ndarray:
  """W = (q − z) · s per group of `group` input columns, float32 [out, in].

  zero_point: [out, in/group] values, or int32 packed along the rows as compressed-tensors
  writes it ([ceil(out/8), in/group]). Parts that disagree with `shape` raise a ValueError
  (the caller names the tensors).
  """
  out_dim, in_dim = check(packed.shape, scale.shape, shape, group)
  groups = -(-in_dim // group)
  if not np.issubdtype(packed.dtype, np.integer):
    raise ValueError(f"int4 packed values have dtype {packed.dtype}, not int32")
  q = unpack(packed, in_dim).astype(np.float32)
  if zero_point is not None:
    if zero_point.dtype == np.int32:              # compressed-tensors packs it along the rows
      if zero_point.shape != (-(-out_dim // PER_WORD), groups):
        raise ValueError(f"int4 packed zero point shape {zero_point.shape} does not match weight shape "
                         f"{(out_dim, in_dim)} (needs {(-(-out_dim // PER_WORD), groups)})")
      zero_point = unpack(zero_point.T, out_dim).T
    elif zero_point.shape != (out_dim, groups):
      raise ValueError(f"int4 zero point shape {zero_point.shape} does not match weight shape "
                       f"{(out_dim, in_dim)} with group size {group}")
    q = q - np.repeat(zero_point.astype(np.float32), group, axis=-1)[:, :in_dim]
  return q * np.repeat(scale.astype(np.float32), group, axis=-1)[:, :in_dim]


def quantize(w: np.ndarray, group: int = 32, scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric per-group INT4: returns (packed int32 [out, in/8], scale [out, in/group] in
  `scale_dtype`). The scale is rounded to `scale_dtype` before q = clip(round(W/s), −8, 7) is
  taken, so that (q, the stored s) is the quantization (a bfloat16 scale, as released)."""
  out_dim, in_dim = w.shape
  if in_dim % group:
    raise ValueError(f"input dim {in_dim} is not a multiple of the group size {group}")
  g = w.astype(np.float32).reshape(out_dim, in_dim // group, group)
  scale = (np.abs(g).max(-1) / 7.5).astype(scale_dtype)
  wide = scale.astype(np.float32)
  safe = np.where(wide == 0, 1.0, wide)
  q = np.clip(np.round(g / safe[..., None]), -8, 7).reshape(out_dim, in_dim)
  return pack(q), scale


def quantization_config(group: int = 32) -> dict:
  """config.json's `quantization_config` of a checkpoint whose routed experts alone are
  pack-quantized (the released K2.5 layout: symmetric int4 groups of `group` input columns;
  attention, shared experts, dense MLPs, the LM head and the vision side stay dense)."""
  weights = {"num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
             "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
  return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                        "output_activations": None}},
          "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*",
                     r"re:.*vision_tower.*", r"re:.*mm_projector.*"],
          "kv_cache_scheme": None}
