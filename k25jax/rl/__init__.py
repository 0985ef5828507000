"""Reinforcement learning: sampler on the MLA latent cache, rollouts, verifiable tasks (`tasks`)."""
