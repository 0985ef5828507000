"""Training losses, pure `jax.numpy`: `from k25jax import losses`."""
from k25jax.losses.lm import first_argmax, head_next_token_loss, next_token_loss
from k25jax.losses.parl import anneal, critical_steps, parl_reward, r_finish, r_parallel
from k25jax.losses.rl import cispo_loss, group_advantages, grpo_loss, k25_policy_loss, ppo_clip_loss
from k25jax.losses.toggle import group_accuracy, length_budgets, toggle_phase, toggle_reward

__all__ = [
    "first_argmax",
    "next_token_loss", "head_next_token_loss",
    "k25_policy_loss", "group_advantages", "ppo_clip_loss", "grpo_loss", "cispo_loss",
    "toggle_reward", "toggle_phase", "group_accuracy", "length_budgets",
    "parl_reward", "r_parallel", "r_finish", "anneal", "critical_steps",
]
