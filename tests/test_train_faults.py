"""Faults: corrupt checkpoints are detected and quarantined, a non-finite update of the state is
skipped, a diverged run stops non-zero, a bad config fails in one line before anything compiles."""
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cpu_env import subprocess_env

from k25jax.train import checkpoint, loop, preemption, state as state_lib
from test_train_step import micro_config, random_batch

ROOT = os.path.join(os.path.dirname(__file__), "..")
DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
PARAMS = {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) / 7.0, "b": jnp.ones(16, jnp.bfloat16)}


def _state(scale):
  return state_lib.create(jax.tree.map(lambda x: x * scale, PARAMS), optax.adam(1e-3), jax.random.PRNGKey(scale))


def _target():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=DEVICE), _state(1))


def _two_steps(workdir):
  saver = checkpoint.Checkpoints(workdir, keep=3)
  saver.save(1, _state(1))
  saver.save(2, _state(2))
  saver.close()
  return os.path.join(workdir, "checkpoints", "2")


def _largest_file(folder):
  files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]
  return max(files, key=os.path.getsize)


def _restore(workdir, caplog):
  saver = checkpoint.Checkpoints(workdir, keep=3)
  with caplog.at_level(logging.WARNING):
    state = saver.restore_latest(_target())
  return saver, state, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _assert_quarantined_and_saved_again(workdir, saver, state, warnings):
  np.testing.assert_array_equal(state.params["w"], PARAMS["w"])            # step 1's state
  assert len(warnings) == 1 and "checkpoint 2" in warnings[0] and "moved to" in warnings[0], warnings
  assert os.listdir(os.path.join(workdir, "checkpoints_quarantine", "2"))    # kept for inspection
  saver.save(2, _state(2))                                                   # the step can be saved again
  saver.close()
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "2"))


def test_a_flipped_bit_in_the_data_is_detected_and_quarantined(tmp_path, caplog):
  step_dir = _two_steps(str(tmp_path))
  data = _largest_file(os.path.join(step_dir, "state"))
  raw = bytearray(open(data, "rb").read())
  raw[len(raw) // 2] ^= 0x10                                  # Orbax reads this back without complaint
  open(data, "wb").write(bytes(raw))
  saver, state, warnings = _restore(str(tmp_path), caplog)
  assert "digests" in warnings[0]
  _assert_quarantined_and_saved_again(str(tmp_path), saver, state, warnings)


@pytest.mark.parametrize("damage", ["delete_metadata", "truncate", "garble"])
def test_an_unreadable_step_is_quarantined(tmp_path, caplog, damage):
  step_dir = _two_steps(str(tmp_path))
  if damage == "delete_metadata":
    os.remove(os.path.join(step_dir, "state", "_METADATA"))
  else:
    data = _largest_file(os.path.join(step_dir, "state"))
    raw = open(data, "rb").read()
    open(data, "wb").write(raw[:len(raw) // 3] if damage == "truncate" else b"\x00garbage" * 8)
  saver, state, warnings = _restore(str(tmp_path), caplog)
  _assert_quarantined_and_saved_again(str(tmp_path), saver, state, warnings)


def test_digests_name_the_changed_array_and_catch_one_bit():
  saved = checkpoint.digests(_state(1))
  flipped = np.asarray(PARAMS["w"]).copy()
  flipped.view(np.uint32)[17, 3] ^= 1 << 30                  # one bit of one float
  changed = _state(1).replace(params={**PARAMS, "w": jnp.asarray(flipped)})
  with pytest.raises(checkpoint.CorruptCheckpoint, match=r"\['w'\]"):
    checkpoint.verify(changed, saved)
  checkpoint.verify(_state(1), saved)


def test_restore_params_checks_the_digests_too(tmp_path):
  step_dir = _two_steps(str(tmp_path))
  data = _largest_file(os.path.join(step_dir, "state"))
  raw = bytearray(open(data, "rb").read())
  raw[len(raw) // 2] ^= 0x10
  open(data, "wb").write(bytes(raw))
  with pytest.raises(checkpoint.CorruptCheckpoint):
    checkpoint.restore_params(str(tmp_path), _target().params)


def test_a_write_that_fails_midway_leaves_the_previous_file_whole(tmp_path):
  path = str(tmp_path / "toggle_budgets.npy")
  checkpoint.write_atomically(path, lambda f: np.save(f, np.arange(3.0)))

  def crash(f):
    f.write(b"\x93NUMPY half a header")
    raise OSError("disk full")
  with pytest.raises(OSError, match="disk full"):
    checkpoint.write_atomically(path, crash)
  np.testing.assert_array_equal(np.load(path), np.arange(3.0))
  assert os.listdir(tmp_path) == ["toggle_budgets.npy"]


@pytest.mark.slow
def test_an_update_that_makes_the_state_non_finite_is_skipped():
  """Loss and gradients are finite, but lr = 1e39 (inf in float32) makes the new params inf."""
  from k25jax.model import transformer
  from k25jax.stages import pretrain
  from k25jax.train import config_utils, optimizer, sharding, trainer as trainer_lib
  config = micro_config()
  config.optimizer.update(lr=1e39, warmup_steps=0)
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  mesh = sharding.make_mesh(dict(data=1), devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    state = trainer_lib.new_state(model, tx, mesh, config.train.seed)
    before = jax.device_get(state.params)
    state, metrics = pretrain.make_step(config, model, tx)(state, random_batch())
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
  assert float(metrics["finite"]) == 0.0 and int(state.skipped) == 1
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)


def test_the_guard_stops_after_the_limit_naming_the_last_good_checkpoint():
  guard = loop.SkipGuard(limit=3, skipped=0, directory="/runs/x/checkpoints")
  guard.observe(1, 0)
  guard.observe(2, 1)                 # one skipped, then a good update: the count starts again
  guard.observe(3, 1)
  guard.saved(3)
  guard.observe(4, 2)
  guard.observe(5, 3)
  guard.saved(5)                      # saved while skipping: not a good checkpoint
  with pytest.raises(loop.Diverged, match=r"stopped at step 6: the last 3 updates were non-finite.*"
                                          r"last good checkpoint is step 3 in /runs/x/checkpoints"):
    guard.observe(6, 4)


def _main(*flags):
  """`python -m k25jax.main` on one device, at LLVM's quickest level: a micro run that stops in a few
  steps compiles more than it runs (the diverging run 27-29 -> 21-24 CPU-s alone, two runs each)."""
  env = subprocess_env(1, compile_bound=True)
  return subprocess.run([sys.executable, "-m", "k25jax.main", *flags], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


BAD_FIELDS = ["--config.train.checkpoint_every=0", "--config.train.batch=0", "--config.train.bogus_field=1",
              "--config.optimizer.name=sgd", "--config.model.num_hidden_layers=0", "--config.mesh.data=-1",
              "--config.rl.num_generations=1", "--config.optimizer.warmup_steps=500"]


@pytest.mark.slow
def test_a_bad_config_field_fails_in_one_line_before_anything_runs():
  """Each bad field in its own `main` process (all started at once: most of each is importing jax)."""
  processes = {}
  for flag in BAD_FIELDS:
    config = "configs/rl.py" if flag.startswith("--config.rl.") else "configs/pretrain.py"
    extra = ["--config.mesh.fsdp=-1"] if flag == "--config.mesh.data=-1" else []   # two axes take "the rest"
    processes[flag] = subprocess.Popen(
        [sys.executable, "-m", "k25jax.main", f"--config={config}", flag, *extra, "--workdir=/nonexistent/never_created"],
        cwd=ROOT, env=subprocess_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  for flag, process in processes.items():
    _, stderr = process.communicate(timeout=600)
    lines = stderr.strip().splitlines()
    assert process.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (flag, stderr[-2000:])
    assert flag.split("=")[0].removeprefix("--config.").split(".")[-1] in lines[0] or "mesh" in lines[0], flag


@pytest.mark.slow
def test_a_diverging_run_stops_non_zero_naming_the_last_good_checkpoint(tmp_path):
  micro = ["--config.model.num_hidden_layers=2", "--config.model.vocab_size=512", "--config.model.hidden_size=64",
           "--config.model.num_attention_heads=2", "--config.model.n_routed_experts=4",
           "--config.model.num_experts_per_tok=2", "--config.train.seq_len=16", "--config.train.batch=2",
           "--config.train.eval_batches=1", "--config.optimizer.warmup_steps=0", "--config.optimizer.decay_steps=1"]
  result = _main("--config=configs/pretrain.py", *micro, "--config.optimizer.lr=1e30", "--config.train.steps=40",
                 "--config.train.checkpoint_every=1", "--config.train.max_consecutive_skipped=5",
                 f"--workdir={tmp_path}")
  last = result.stderr.strip().splitlines()[-1]
  assert result.returncode == 1, result.stderr[-3000:]
  assert last.startswith("error: stopped at step") and "the last 5 updates were non-finite" in last
  assert "last good checkpoint is step 1 in" in last and str(tmp_path) in last


def test_a_nan_in_an_evaluation_is_a_warning(tmp_path, caplog):
  from test_train_loop import fake_step
  state = state_lib.TrainState(step=jnp.int32(0), params={}, opt_state=(), rng=jnp.zeros(2, jnp.uint32),
                               skipped=jnp.int32(0))
  writer = loop.MetricWriter(str(tmp_path))
  with caplog.at_level(logging.WARNING):
    loop.train(state, train_step=fake_step(nan_at=-1), batch_at=lambda step: 4.0, total_steps=4, tokens_per_step=4,
               log_every=4, eval_every=2, checkpoint_every=4,
               evaluate_fn=lambda s: {"loss": float("nan") if int(s.step) == 4 else 1.0, "tokens": 8.0},
               save_fn=lambda n, s: None, writer=writer, guard=loop.SkipGuard(3, 0, str(tmp_path)),
               stopper=preemption.Stopper(str(tmp_path)))
  writer.close()
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warnings == ["evaluation at step 4 gave non-finite values: loss nan"]
