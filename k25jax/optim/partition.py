"""The partition of the params among the optimizers: which one updates each parameter of the
K2 decoder, and how Muon sees it as a matrix.

    frozen : e_score_correction_bias (the router bias; the train step sets it by its own rule)
    adamw  : embed_tokens, lm_head, the router kernel (mlp/gate/kernel), norms, biases
    muon   : every other kernel, as matrices W ∈ R^{rows × cols}, rows = input, cols = output

Muon's matrix of a kernel is the linear map of the checkpoint's `nn.Linear`:

    kernel                              shape              batch   rows         cols
    2-D kernels                         [in, out]          —       in           out
    q_proj, q_b_proj, kv_b_proj         [in, H, c]         —       in           H·c
    o_proj                              [H, v, d]          —       H·v          d
    mlp/experts/*                       [E, in, out]       E       in           out

so each routed expert's matrix is orthogonalised on its own, never across experts. A leaf
of the scanned MoE layers (`moe_layers`, scan_layers=True) has a leading [layers] axis:
it is one more batch axis, so each layer's matrices stay apart too.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from k25jax.model.moe import ROUTER_BIAS
from k25jax.model.transformer import SCANNED

MUON, ADAMW, FROZEN = "muon", "adamw", "frozen"

# Kernels whose input spans several axes (per-head outputs fed to one projection).
_INPUT_AXES = {"o_proj": 2}
_HEAD_OUTPUTS = ("q_proj", "q_b_proj", "kv_b_proj")


class MatrixAxes(NamedTuple):
  """How a kernel is read as a (batch of) matrices: axes that index the batch, the rows
  (input, contracted with the activations) and the columns (output)."""

  batch: tuple[int, ...]
  rows: tuple[int, ...]
  cols: tuple[int, ...]


def names(path) -> tuple[str, ...]:
  """The dict keys of a tree path (a `nn.LogicallyPartitioned` box adds no name)."""
  return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def stacked_axes(path) -> int:
  """1 for a leaf of the scanned MoE layers (leading [layers] axis), 0 otherwise."""
  return int(SCANNED in names(path))


def is_matrix(path, leaf) -> bool:
  """True when one layer's copy of the leaf has >= 2 axes (weight decay and Muon apply)."""
  return len(leaf.shape) - stacked_axes(path) >= 2


def matrix_mask(params):
  """The tree of `is_matrix` (the weight-decay mask)."""
  return jax.tree_util.tree_map_with_path(is_matrix, params)


def label(path, leaf) -> str:
  """MUON, ADAMW or FROZEN for the parameter at `path` (see the module docstring)."""
  keys = names(path)
  if keys[-1] == ROUTER_BIAS:
    return FROZEN
  if keys[0] in ("embed_tokens", "lm_head") or keys[-2:] == ("gate", "kernel") or not is_matrix(path, leaf):
    return ADAMW
  return MUON


def labels(params):
  """The tree of `label`s (works on plain and on `nn.LogicallyPartitioned`-boxed params)."""
  return jax.tree_util.tree_map_with_path(label, params)


def matrix_axes(path, shape: tuple[int, ...]) -> MatrixAxes:
  """The batch / row / column axes of the Muon parameter at `path` with `shape`."""
  if stacked_axes(path):
    layer = _layer_matrix_axes(names(path), shape[1:])
    shift = lambda axes: tuple(a + 1 for a in axes)
    return MatrixAxes((0,) + shift(layer.batch), shift(layer.rows), shift(layer.cols))
  return _layer_matrix_axes(names(path), shape)


def _layer_matrix_axes(keys: tuple[str, ...], shape: tuple[int, ...]) -> MatrixAxes:
  """`matrix_axes` of one layer's parameter (no stacked layer axis)."""
  ndim = len(shape)
  if ndim == 2:
    return MatrixAxes((), (0,), (1,))
  if "experts" in keys and ndim == 3:
    return MatrixAxes((0,), (1,), (2,))
  module = keys[-2] if len(keys) >= 2 else ""
  if module in _HEAD_OUTPUTS and ndim == 3:
    return MatrixAxes((), (0,), (1, 2))
  if module in _INPUT_AXES and ndim == _INPUT_AXES[module] + 1:
    n_in = _INPUT_AXES[module]
    return MatrixAxes((), tuple(range(n_in)), (n_in,))
  raise ValueError(f"muon: no matrix layout for the {ndim}-D parameter {'/'.join(keys)} {shape}; "
                   f"add it to k25jax/optim/partition.py or assign it to AdamW")
