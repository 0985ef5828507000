"""The train state: one pytree holding everything a step reads and writes."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax


@flax.struct.dataclass
class TrainState:
  """step (int32), params, opt_state, rng (a raw uint32 key) and `skipped`, the number of
  steps whose loss or gradients were non-finite and whose update was therefore dropped."""

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  skipped: jax.Array


def create(params, tx: optax.GradientTransformation, rng: jax.Array) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    rng=rng, skipped=jnp.zeros((), jnp.int32))


def abstract(boxed_params, tx: optax.GradientTransformation) -> TrainState:
  """Shapes of the state without allocating. `boxed_params` are abstract params in
  `nn.LogicallyPartitioned` boxes; the boxes carry into the optimizer state, so
  `nn.get_partition_spec` of the result gives every leaf's logical axes."""
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  return TrainState(step=scalar, params=boxed_params, opt_state=jax.eval_shape(tx.init, boxed_params),
                    rng=jax.ShapeDtypeStruct((2,), jnp.uint32), skipped=scalar)
