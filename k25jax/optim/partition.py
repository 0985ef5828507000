"""The partition of the params among the optimizers: which one updates each parameter of the
K2 decoder or of the whole K2.5 model, and how Muon sees it as a matrix.

The K2.5 params are {language_model: the decoder's, vision_tower: ..., mm_projector: ...};
a bare decoder's params are read as the language model's.

    frozen : e_score_correction_bias (the router bias; the train step sets it by its own rule)
    adamw  : the embeddings (language_model/embed_tokens, vision_tower/patch_embed: the patch
             projection and the learned position table), language_model/lm_head, the router
             kernel (mlp/gate/kernel), every bias, every norm and every other 1-D tensor
    muon   : every other kernel (decoder, vision tower, projector), as matrices
             W ∈ R^{rows × cols}, rows = input, cols = output

Muon's matrix of a kernel is the linear map of the checkpoint's `nn.Linear`:

    kernel                              shape              batch   rows         cols
    2-D kernels (decoder, fc0/fc1,      [in, out]          —       in           out
      proj_0/proj_2)
    q_proj, q_b_proj, kv_b_proj         [in, H, c]         —       in           H·c
    o_proj                              [H, v, d]          —       H·v          d
    mlp/experts/*                       [E, in, out]       E       in           out
    vision wqkv (fused q, k, v)         [d, 3, H, c]       —       d            3·H·c
    vision wo                           [H, c, d]          —       H·c          d

so each routed expert's matrix is orthogonalised on its own, never across experts. A leaf
of the scanned MoE layers (`moe_layers`, scan_layers=True) has a leading [layers] axis:
it is one more batch axis, so each layer's matrices stay apart too. Weight decay (both
optimizers) applies to the tensors `is_matrix` accepts: kernels, embeddings, the position
table, not norms or biases.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from k25jax.model.k25 import LANGUAGE_MODEL, PROJECTOR, VISION_TOWER
from k25jax.model.moe import ROUTER_BIAS
from k25jax.model.transformer import SCANNED

MUON, ADAMW, FROZEN = "muon", "adamw", "frozen"

# Per part of the model, the top-level modules updated by AdamW although they hold matrices.
_ADAMW_MODULES = {LANGUAGE_MODEL: ("embed_tokens", "lm_head"), VISION_TOWER: ("patch_embed",), PROJECTOR: ()}
# Kernels whose input spans several axes (per-head outputs fed to one projection).
_INPUT_AXES = {"o_proj": 2, "wo": 2}
# Kernels [in, *out] whose output spans several axes (heads, and q/k/v in the fused wqkv).
_MULTI_OUTPUTS = {"q_proj": 3, "q_b_proj": 3, "kv_b_proj": 3, "wqkv": 4}


class MatrixAxes(NamedTuple):
  """How a kernel is read as a (batch of) matrices: axes that index the batch, the rows
  (input, contracted with the activations) and the columns (output)."""

  batch: tuple[int, ...]
  rows: tuple[int, ...]
  cols: tuple[int, ...]


def names(path) -> tuple[str, ...]:
  """The dict keys of a tree path (a `nn.LogicallyPartitioned` box adds no name)."""
  return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def part(keys: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
  """(the K2.5 part, the keys inside it); a bare decoder's keys are the language model's."""
  if keys[0] in _ADAMW_MODULES:
    return keys[0], keys[1:]
  return LANGUAGE_MODEL, keys


def stacked_axes(path) -> int:
  """1 for a leaf of the scanned MoE layers (leading [layers] axis), 0 otherwise."""
  return int(SCANNED in names(path))


def is_matrix(path, leaf) -> bool:
  """True when one layer's copy of the leaf has >= 2 axes and is not a bias (weight decay
  and Muon apply; the vision tower's fused qkv bias [3, H, c] is a bias)."""
  return names(path)[-1] != "bias" and len(leaf.shape) - stacked_axes(path) >= 2


def matrix_mask(params):
  """The tree of `is_matrix` (the weight-decay mask)."""
  return jax.tree_util.tree_map_with_path(is_matrix, params)


def label(path, leaf) -> str:
  """MUON, ADAMW or FROZEN for the parameter at `path` (see the module docstring)."""
  keys = names(path)
  if keys[-1] == ROUTER_BIAS:
    return FROZEN
  model_part, inner = part(keys)
  if inner[0] in _ADAMW_MODULES[model_part] or keys[-2:] == ("gate", "kernel") or not is_matrix(path, leaf):
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
  if _MULTI_OUTPUTS.get(module) == ndim:
    return MatrixAxes((), (0,), tuple(range(1, ndim)))
  if module in _INPUT_AXES and ndim == _INPUT_AXES[module] + 1:
    n_in = _INPUT_AXES[module]
    return MatrixAxes((), tuple(range(n_in)), (n_in,))
  raise ValueError(f"muon: no matrix layout for the {ndim}-D parameter {'/'.join(keys)} {shape}; "
                   f"add it to k25jax/optim/partition.py or assign it to AdamW")
