"""Training stages: each module exposes `make_step(config, model, tx)` and `run(config, workdir)`."""
