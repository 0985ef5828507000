"""Training losses, pure `jax.numpy`: `from k25jax import losses`."""
from k25jax.losses.lm import next_token_loss

__all__ = ["next_token_loss"]
