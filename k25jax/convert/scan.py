"""Params of the K2 decoder: per-layer layout ⇄ scanned layout.

    per layer   {"layers_0": {...}, …, "layers_{L-1}": {...}, "embed_tokens", "norm", "lm_head"}
    scanned     {"layers_0": {...}, …, "layers_{k-1}": {...},              (the k dense layers)
                 "moe_layers": {...},                                     (leaves [L-k, ...])
                 "embed_tokens", "norm", "lm_head"}

with k = first_k_dense_replace: leaf `moe_layers/.../w` at index i is `layers_{k+i}/.../w`.
The per-layer layout is the one the Hugging Face names map to (`k25jax.convert.hf`), and
the one the latent-cache decode path runs; the scanned one compiles one layer body
(`ModelConfig.scan_layers`). Works on any tree with this structure (params, or optimizer
moments shaped like them), on NumPy or JAX arrays.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k25jax.model.config import ModelConfig
from k25jax.model.transformer import SCANNED


def is_scanned(params) -> bool:
  return SCANNED in params


def _stack(*leaves):
  return (np.stack(leaves) if all(isinstance(x, np.ndarray) for x in leaves) else jnp.stack(leaves))


def stack_layers(cfg: ModelConfig, params, stack=None) -> dict:
  """Per-layer → scanned: layers_{k} … layers_{L-1} become `moe_layers` with a leading layer axis
  (`stack(*leaves)`, default np.stack / jnp.stack: e.g. `lazy.stacked` for leaves not yet read)."""
  if is_scanned(params):
    raise ValueError(f"stack_layers: the params are already scanned (they have {SCANNED!r})")
  moe = [f"layers_{i}" for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers)]
  missing = [name for name in moe if name not in params]
  if missing:
    raise ValueError(f"stack_layers: the params have no {missing[0]!r} (config has {cfg.num_hidden_layers} "
                     "layers)")
  out = {k: v for k, v in params.items() if k not in moe}
  if moe:
    out[SCANNED] = jax.tree.map(stack or _stack, *[params[name] for name in moe])
  return out


def unstack_layers(cfg: ModelConfig, params) -> dict:
  """Scanned → per-layer: row i of every `moe_layers` leaf becomes layers_{k+i}."""
  if not is_scanned(params):
    raise ValueError(f"unstack_layers: the params are not scanned (no {SCANNED!r})")
  stacked = params[SCANNED]
  depth = {x.shape[0] for x in jax.tree.leaves(stacked)}
  if depth != {cfg.num_moe_layers}:
    raise ValueError(f"unstack_layers: {SCANNED!r} holds {sorted(depth)} layers, the config "
                     f"{cfg.num_moe_layers} MoE layers")
  out = {k: v for k, v in params.items() if k != SCANNED}
  for i in range(cfg.num_moe_layers):
    out[f"layers_{cfg.first_k_dense_replace + i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
  return out


def to_layout(cfg: ModelConfig, params, stack=None) -> dict:
  """The params in the layout `cfg.scan_layers` asks for (converted only if they are not;
  `stack` as stack_layers')."""
  if cfg.scan_layers and cfg.num_moe_layers and not is_scanned(params):
    return stack_layers(cfg, params, stack)
  if not cfg.scan_layers and is_scanned(params):
    return unstack_layers(cfg, params)
  return params
