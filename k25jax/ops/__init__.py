"""Pure jax.numpy building blocks below the model and the Pallas kernels; no Flax."""
