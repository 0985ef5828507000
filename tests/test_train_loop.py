"""The generic loop: when it logs, evaluates and saves, and how it reports skipped steps."""
import logging
import os

import jax.numpy as jnp
import numpy as np
from tensorboard.backend.event_processing import event_accumulator

from k25jax.train import loop, preemption
from k25jax.train.state import TrainState


def fake_step(nan_at):
  """Counts steps; the update at step `nan_at` is 'non-finite'."""
  def step(state, batch):
    skipped = state.skipped + (state.step + 1 == nan_at)
    new = state.replace(step=state.step + 1, skipped=skipped)
    return new, {"loss": 10.0 / (state.step + 1.0), "skipped_steps": skipped, "tokens": batch}
  return step


def test_schedule_of_logs_evals_saves_and_skip_warning(tmp_path, caplog):
  state = TrainState(step=jnp.int32(2), params={}, opt_state=(), rng=jnp.zeros(2, jnp.uint32),
                     skipped=jnp.int32(0))
  saved, writer = [], loop.MetricWriter(str(tmp_path))
  with caplog.at_level(logging.INFO):
    state, history = loop.train(
        state, train_step=fake_step(nan_at=5), batch_at=lambda step: 4.0, total_steps=10, tokens_per_step=4,
        log_every=4, eval_every=5, checkpoint_every=3,
        evaluate_fn=lambda s: {"loss": float(s.step), "tokens": 1.0},
        save_fn=lambda n, s: saved.append((n, int(s.step))), writer=writer,
        guard=loop.SkipGuard(limit=3, skipped=0, directory=str(tmp_path)), stopper=preemption.Stopper(str(tmp_path)))
  writer.close()
  assert int(state.step) == 10
  assert [h["step"] for h in history if h["split"] == "train"] == [4, 8, 10]     # resumed at 2: no step 1
  assert [h["step"] for h in history if h["split"] == "eval"] == [5, 10]
  assert saved == [(3, 3), (6, 6), (9, 9), (10, 10)]
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "up to step 8" in warnings[0] and "non-finite" in warnings[0]
  assert any("step 10/10" in r.getMessage() and "ETA" in r.getMessage() for r in caplog.records)
  events = event_accumulator.EventAccumulator(os.path.join(tmp_path, "tensorboard"))   # tensorboard's own reader
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(5, 5.0), (10, 10.0)]
  assert [e.step for e in events.Scalars("train/loss")] == [4, 8, 10]


def test_evaluate_weights_by_tokens():
  batches = [(1.0, 10.0), (4.0, 30.0)]
  metrics = loop.evaluate(lambda s, b: {"loss": np.float32(b[0]), "tokens": np.float32(b[1])}, None, batches)
  assert metrics["tokens"] == 40.0 and abs(metrics["loss"] - 3.25) < 1e-6


def test_checkpoint_minutes_saves_by_a_clock_as_well_as_by_steps(tmp_path):
  """A step takes 50 s of the test's clock; train.checkpoint_minutes = 2 with checkpoint_every = 7:
  saves at 3 (150 s), 6 (150 s after it), 7 (the step count), 10 (150 s after 7) and 12 (the last)."""
  state = TrainState(step=jnp.int32(0), params={}, opt_state=(), rng=jnp.zeros(2, jnp.uint32), skipped=jnp.int32(0))
  now, saved = [0.0], []
  stopper = preemption.Stopper(str(tmp_path), checkpoint_minutes=2.0, clock=lambda: now[0])

  def step(state, batch):
    now[0] += 50.0
    return fake_step(nan_at=-1)(state, batch)

  writer = loop.MetricWriter(str(tmp_path))
  loop.train(state, train_step=step, batch_at=lambda step: 4.0, total_steps=12, tokens_per_step=4, log_every=12,
             eval_every=12, checkpoint_every=7, evaluate_fn=None, save_fn=lambda n, s: saved.append(n), writer=writer,
             guard=loop.SkipGuard(limit=3, skipped=0, directory=str(tmp_path)), stopper=stopper)
  writer.close()
  assert saved == [3, 6, 7, 10, 12]
