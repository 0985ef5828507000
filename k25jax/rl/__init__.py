"""Reinforcement learning: the one RL driver (`driver`) with its policy losses (`policy_loss`) and
loss rows (`rollout`), batched decoding (`decode`) on the MLA latent-cache sampler (`sampler`),
and verifiable tasks (`tasks`)."""
