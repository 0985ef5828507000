"""Runs that tests in several files share, trained once per test session whichever xdist
worker asks first (the others wait on a file lock, then read it).

They live under $K25JAX_TEST_SHARED_DIR, which tests/conftest.py makes for the session.
"""
import fcntl
import json
import os

from config_files import load_config

# The compact Toggle warm start trains until it answers this share of the held-out prompts
# right (sampled), checked every CHUNK steps from FIRST_CHECK on, at most AT_MOST steps.
SOME_RIGHT = 0.2
FIRST_CHECK, CHUNK, AT_MOST = 250, 25, 500


def shared_dir() -> str:
  return os.environ["K25JAX_TEST_SHARED_DIR"]


def compact_toggle_rl_config():
  """configs/rl.py:tiny,toggle,compact with a short warm start (a constant lr after 10 warmup
  steps, so that training on continues the same run), 64 training prompts, on one device."""
  config = load_config("configs/rl.py", "tiny,toggle,compact")
  config.warm_start.update(demonstrations=4096, steps=FIRST_CHECK, batch=64, log_every=CHUNK,
                           checkpoint_every=CHUNK)
  config.warm_start.optimizer.update(warmup_steps=10, decay_steps=0)
  config.task.update(train_prompts=64, eval_prompts=8)
  config.mesh.devices = 1      # one of the 8 test devices: the warm start 53 CPU-s, against 82 on all 8
  return config


def compact_toggle_warm_start() -> str:
  """The workdir of `compact_toggle_rl_config`'s built-in warm start (an `init.checkpoint`),
  trained to the first multiple of CHUNK steps at or after FIRST_CHECK whose held-out sampled
  accuracy (configs/rl.py:tiny,compact's 256 held-out prompts, 2 samples each, the RL stage's
  own evaluation and key) is at least SOME_RIGHT, so that groups get different rewards.

  A number of steps would not do: addition is learned abruptly, and where depends on the
  floats (the figures below were measured on all 8 test devices, before this run moved to
  one). At 250 steps under the earlier schedule (a decay over the last 50) held-out accuracy
  was 0.24 on one machine, 0.19 on an AVX-512 Xeon at AVX2, 0.10 on an AMD EPYC, and 0.02 at
  warm_start.seed 2 and 3 on the EPYC; at 400 steps 0.82. At a constant lr on the EPYC, seed 0
  went 0.03, 0.14, 0.24, 0.38 at 225, 250, 275, 300 steps and seed 2 0.03, 0.05, 0.16, 0.25 at
  275-350. Trained to the band, test_rl_raises_held_out_accuracy gained 0.106, 0.084 and 0.105 in
  15 iterations from warm-start seeds 0, 2 and 3 (275, 350 and 400 steps; its margin is 0.06)."""
  import jax
  from k25jax.model import transformer
  from k25jax.stages import rl
  from k25jax.train import config_utils, sharding
  config = compact_toggle_rl_config()
  config.mesh.update(data=-1, fsdp=1)
  workdir = os.path.join(shared_dir(), "rl_warm_starts", "compact_toggle")
  os.makedirs(workdir, exist_ok=True)
  reached = os.path.join(workdir, "reached.json")
  with open(os.path.join(workdir, ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)         # released when the file closes
    if not os.path.exists(reached):
      model = transformer.Transformer(config_utils.model_config_from(config.model))
      mesh = sharding.make_mesh(config.mesh.to_dict())
      held_out_config = load_config("configs/rl.py", "tiny,compact")
      with jax.set_mesh(mesh):
        task = rl.make_task(config, model.cfg.max_position_embeddings)
        held_out = rl.make_task(held_out_config, model.cfg.max_position_embeddings)
        sampling = rl.sampling_config(held_out_config, held_out)
        for steps in range(FIRST_CHECK, AT_MOST + 1, CHUNK):
          config.warm_start.steps = steps
          params = rl.builtin_warm_start(config, model, task, mesh, workdir)   # resumes from the last chunk
          accuracy = rl.evaluate(model.cfg, params, held_out, jax.random.PRNGKey(held_out_config.train.seed + 1),
                                 sampling, held_out_config.rl.eval_samples)["accuracy"]
          if accuracy >= SOME_RIGHT:
            break
        else:
          raise RuntimeError(f"the compact warm start reached held-out sampled accuracy {accuracy:.3f} at "
                             f"{AT_MOST} steps, not {SOME_RIGHT}")
      with open(reached, "w") as f:
        json.dump({"steps": steps, "accuracy": accuracy}, f)
  return os.path.join(workdir, "warm_start")
