"""Training stages, one module each, every one a leaf: `run(config, workdir)` turns a config into
data or tasks and hands them to the one trainer (`k25jax.train.trainer`: vit, pretrain,
midtrain, sft) or the one RL driver (`k25jax.rl.driver`: rl, rl_vision, parl)."""
