"""The generic jitted train / eval step around a stage's loss.

    (loss, aux), g = value_and_grad(loss_fn)(θ, batch, rng)
    u, s'          = tx.update(g, s, θ);  θ' = θ + u
    b'_l           = b_l + γ · sign(mean(load_l) − load_l)      per MoE layer l (router bias)
    θ'             = QK-Clip(θ', S_max, τ)                      MuonClip only (k25jax.optim.muonclip)
    if loss, g, θ' or s' is non-finite:  θ' = θ, s' = s, skipped += 1   (the step still advances)
    if the loss gates the batch off (metrics[UPDATE_GATE] = 0):  θ' = θ, s' = s

A stage supplies `loss_fn(params, batch, rng) -> (loss, (metrics, model_aux))`, with
`model_aux` the model's aux dict (`expert_load` [moe_layers, E]; `max_logits` [layers,
heads] when QK-Clip is on). Its metrics may hold UPDATE_GATE, 0 for a batch that carries no
gradient at all (an RL minibatch whose advantages are all 0): the gradient is then float
noise, and a scale-invariant optimizer would turn it into a full step (Muon orthogonalises
a 1e-9 gradient into the same update as a unit one), so nothing is updated. A gated step
is not a skipped one; it is logged as `gated`.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from k25jax.model import moe, transformer
from k25jax.optim import muonclip
from k25jax.train import sharding
from k25jax.train.state import TrainState

LossFn = Callable[[Any, dict, jax.Array], tuple[jax.Array, tuple[dict, dict]]]
UPDATE_GATE = "update_gate"


def _with_router_bias(layer: dict, load: jax.Array, gamma: float) -> dict:
  """A layer's params with its router bias (a [E] vector, or [layers, E] when scanned) updated."""
  mlp = dict(layer["mlp"])
  gate = dict(mlp["gate"])
  gate[moe.ROUTER_BIAS] = moe.update_router_bias(gate[moe.ROUTER_BIAS], load, gamma)
  mlp["gate"] = gate
  return dict(layer, mlp=mlp)


def update_router_biases(params, expert_load: jax.Array, gamma: float, first_moe_layer: int):
  """Applies `moe.update_router_bias` to layers_{first_moe_layer + i} with load row i (to the
  stacked `moe_layers` with all rows at once when the params are scanned)."""
  params = dict(params)
  if transformer.SCANNED in params:
    params[transformer.SCANNED] = _with_router_bias(params[transformer.SCANNED], expert_load, gamma)
    return params
  for i in range(expert_load.shape[0]):
    name = f"layers_{first_moe_layer + i}"
    params[name] = _with_router_bias(params[name], expert_load[i], gamma)
  return params


def all_finite(*trees_and_specs) -> jax.Array:
  """True iff every element of every floating leaf of the trees is finite.

  Each argument is (tree, its mesh PartitionSpecs). Leaves of one shape, dtype and spec are
  checked together, ∧_leaf isfinite(leaf) elementwise and then one reduction, so a state
  compiles to one reduction per distinct (shape, dtype, spec) and needs no resharding, where
  one reduction per leaf was half the compile time of a small K2.5 train step (~800 leaves
  in its gradients, params and optimizer state)."""
  masks = {}
  for tree, specs in trees_and_specs:
    leaves, spec_leaves = jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=sharding.is_spec)
    if len(leaves) != len(spec_leaves):
      raise ValueError(f"all_finite: {len(leaves)} leaves against {len(spec_leaves)} specs")
    for x, spec in zip(leaves, spec_leaves):
      if jnp.issubdtype(x.dtype, jnp.inexact):
        key, finite = (x.shape, x.dtype, spec), jnp.isfinite(x)
        masks[key] = finite if key not in masks else masks[key] & finite
  return jnp.all(jnp.stack([jnp.all(m) for m in masks.values()])) if masks else jnp.bool_(True)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, abstract_state: TrainState, *,
                    router_gamma: float, first_moe_layer: int, qk_clip_tau: float | None = None,
                    batch_specs=None, lm_key: str | None = None):
  """`step(state, batch) -> (state, metrics)`, one `jax.jit` with shardings, state donated.

  Call it under `jax.set_mesh(mesh)`; batch leaves are [batch, seq] arrays, unless
  `batch_specs` (a PartitionSpec tree prefix of the batch) says otherwise. With
  `qk_clip_tau`, QK-Clip follows the update and its counts go to the metrics. `lm_key`:
  the decoder's params are `params[lm_key]` (the K25 model's "language_model"), for the
  router-bias update and QK-Clip.
  """
  specs = sharding.mesh_specs(abstract_state)
  batch_spec = P(sharding.BATCH_AXES, "sequence") if batch_specs is None else batch_specs

  def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    rng, step_rng = jax.random.split(state.rng)
    with nn.logical_axis_rules(sharding.RULES):
      (loss, (metrics, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          state.params, batch, step_rng)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    lm = params if lm_key is None else params[lm_key]
    if aux["expert_load"].shape[0]:
      lm = update_router_biases(lm, aux["expert_load"], router_gamma, first_moe_layer)
    if qk_clip_tau is not None:
      lm, clip = muonclip.qk_clip(lm, aux["max_logits"], qk_clip_tau)
      per_layer = {f"qk_clip/max_logit_layer_{i}": m for i, m in enumerate(clip["max_logit_per_layer"])}
      metrics = {**metrics, "qk_clip/clipped_heads": clip["clipped_heads"],
                 "qk_clip/max_logit": clip["max_logit"], **per_layer}
    params = lm if lm_key is None else {**params, lm_key: lm}
    finite = jnp.isfinite(loss) & all_finite((grads, specs.params), (params, specs.params),
                                             (opt_state, specs.opt_state))
    gated = {}
    apply = finite
    if UPDATE_GATE in metrics:
      metrics = dict(metrics)
      gate = metrics.pop(UPDATE_GATE) > 0
      apply, gated = finite & gate, {"gated": 1.0 - gate.astype(jnp.float32)}
    # One conditional for the whole state, not a select per leaf: the same values, a fraction of the kernels.
    params, opt_state = jax.lax.cond(apply, lambda: (params, opt_state), lambda: (state.params, state.opt_state))
    skipped = state.skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng, skipped=skipped)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                   finite=finite.astype(jnp.float32), skipped_steps=skipped, **gated)
    return new_state, metrics

  return jax.jit(step, in_shardings=(specs, batch_spec), out_shardings=(specs, P()),
                 donate_argnums=0)


def make_eval_step(loss_fn: LossFn, abstract_state: TrainState, batch_specs=None):
  """`eval_step(state, batch) -> metrics` (the loss and the stage's metrics, no update)."""
  specs = sharding.mesh_specs(abstract_state)
  batch_spec = P(sharding.BATCH_AXES, "sequence") if batch_specs is None else batch_specs

  def eval_step(state: TrainState, batch: dict) -> dict:
    with nn.logical_axis_rules(sharding.RULES):
      loss, (metrics, _) = loss_fn(state.params, batch, state.rng)
    return dict(metrics, loss=loss)

  return jax.jit(eval_step, in_shardings=(specs, batch_spec), out_shardings=P())
