"""FP8 block-scaled weights, as DeepSeek-V3 and Kimi-K2 ship them.

A linear weight W [out, in] is stored as `weight` (float8 e4m3) and `weight_scale_inv`
[ceil(out/b0), ceil(in/b1)] (float32), one scale per b0 x b1 block (`weight_block_size` of
config.json's `quantization_config`, 128 x 128 in the released checkpoints):

    W[i, j] = weight[i, j] * weight_scale_inv[i // b0, j // b1]
"""
from __future__ import annotations

import numpy as np

SCALE = "weight_scale_inv"


def block_size(hf_cfg: dict) -> tuple[int, int] | None:
  """The (b0, b1) blocks of an FP8 `quantization_config` (quant_method "fp8"), or None."""
  qc = hf_cfg.get("quantization_config") or (hf_cfg.get("text_config") or {}).get("quantization_config") or {}
  if qc.get("quant_method") != "fp8":
    return None
  rows, cols = qc.get("weight_block_size") or (128, 128)
  if int(rows) <= 0 or int(cols) <= 0:
    raise ValueError(f"weight_block_size {[rows, cols]} must be positive")
  return int(rows), int(cols)


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """W = weight * scale_inv, the scale of block (i // b0, j // b1) on element (i, j); float32."""
  if weight.ndim != 2:
    raise ValueError(f"an FP8 weight is 2-D, got shape {weight.shape}")
  rows, cols = weight.shape
  want = (-(-rows // block[0]), -(-cols // block[1]))
  if tuple(scale_inv.shape) != want:
    raise ValueError(f"{SCALE} has shape {tuple(scale_inv.shape)}; a {weight.shape} weight in "
                     f"{block[0]}x{block[1]} blocks needs {want}")
  expanded = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)
  return weight.astype(np.float32) * expanded[:rows, :cols]
