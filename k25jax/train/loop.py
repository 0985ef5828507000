"""The generic training loop: step, log, evaluate, checkpoint, and stop a diverged run.

Progress lines give step, loss, tokens/s and ETA; every logged scalar also goes to
TensorBoard (`workdir/tensorboard`, written by process 0 only). A run whose last
`max_consecutive_skipped` updates were all skipped as non-finite stops with `Diverged`; a
run sent SIGTERM or SIGINT saves at the next step boundary and stops with `Preempted`
(`k25jax.train.preemption`, which also makes a checkpoint due by wall-clock time).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Iterable

import jax
import numpy as np
from absl import logging
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from k25jax.train import preemption


class MetricWriter:
  """TensorBoard scalars (`tensorboard`'s event files: an Event per scalar, its Summary's
  `simple_value`), from process 0 only; non-finite values (e.g. a rate with no events) are
  left out."""

  def __init__(self, workdir: str):
    self.writer = (EventFileWriter(os.path.join(workdir, "tensorboard")) if jax.process_index() == 0 else None)

  def write(self, step: int, scalars: dict, prefix: str) -> None:
    if self.writer is None:
      return
    values = [summary_pb2.Summary.Value(tag=f"{prefix}/{name}", simple_value=float(value))
              for name, value in scalars.items() if np.isfinite(value)]
    self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                          summary=summary_pb2.Summary(value=values)))
    self.writer.flush()

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()


class Progress:
  """Throughput and ETA between consecutive log lines."""

  def __init__(self, total_steps: int, tokens_per_step: int, step: int):
    self.total, self.tokens_per_step = total_steps, tokens_per_step
    self.last_step, self.last_time = step, time.perf_counter()

  def line(self, step: int, metrics: dict) -> str:
    now = time.perf_counter()
    per_step = (now - self.last_time) / max(step - self.last_step, 1)
    self.last_step, self.last_time = step, now
    eta = per_step * (self.total - step)
    return (f"step {step}/{self.total}  loss {metrics['loss']:.4f}  "
            f"tokens/s {self.tokens_per_step / per_step:,.0f}  ETA {eta / 60:.1f} min  "
            f"skipped {int(metrics.get('skipped_steps', 0))}")


def evaluate(eval_step: Callable, state, batches: Iterable[dict]) -> dict:
  """Token-weighted means of `eval_step`'s metrics over `batches` (`tokens` is summed)."""
  totals, tokens = {}, 0.0
  for batch in batches:
    metrics = jax.device_get(eval_step(state, batch))
    n = float(metrics["tokens"])
    tokens += n
    for name, value in metrics.items():
      totals[name] = totals.get(name, 0.0) + float(value) * n
  return {name: (tokens if name == "tokens" else value / max(tokens, 1.0)) for name, value in totals.items()}


class Diverged(RuntimeError):
  """A run that can no longer make progress: too many updates in a row were skipped."""


class SkipGuard:
  """Counts the updates skipped in a row (the train step drops a non-finite one and counts it in
  `skipped_steps`) and raises `Diverged` at `limit` of them, naming the last checkpoint saved
  before the skipping began."""

  def __init__(self, limit: int, skipped: int, directory: str):
    self.limit, self.skipped, self.directory = limit, skipped, directory
    self.in_a_row, self.last_good = 0, None

  def observe(self, step: int, skipped_steps) -> None:
    """The cumulative skip count after `step` (a device scalar is fine: it is read here)."""
    skipped = int(jax.device_get(skipped_steps))
    self.in_a_row = self.in_a_row + 1 if skipped > self.skipped else 0
    self.skipped = skipped
    if self.in_a_row >= self.limit:
      last = (f"the last good checkpoint is step {self.last_good} in {self.directory}" if self.last_good is not None
              else "no checkpoint was saved before it")
      raise Diverged(f"stopped at step {step}: the last {self.in_a_row} updates were non-finite (loss, gradients or "
                     f"the updated state) and skipped, so the run can no longer make progress; {last}. Lower "
                     "optimizer.lr or check the data, then rerun to resume from it.")

  def saved(self, step: int) -> None:
    if self.in_a_row == 0:
      self.last_good = step


def warn_if_not_finite(where: str, metrics: dict) -> None:
  """One warning naming the non-finite values of an evaluation (NaN in a held-out batch, say)."""
  bad = [f"{name} {value}" for name, value in metrics.items() if not np.isfinite(value)]
  if bad:
    logging.warning("%s gave non-finite values: %s", where, ", ".join(bad))


def due(step: int, every: int, last: int) -> bool:
  """True at every `every`-th step (1-based) and at the `last` one: when to log, evaluate, save."""
  return step % every == 0 or step == last


def train(state, *, train_step: Callable, batch_at: Callable[[int], dict], total_steps: int,
          tokens_per_step: int, log_every: int, eval_every: int, checkpoint_every: int,
          evaluate_fn: Callable | None, save_fn: Callable, writer: MetricWriter, guard: SkipGuard,
          stopper: preemption.Stopper):
  """Runs `train_step` from `state.step` to `total_steps` on `batch_at(step)`, the batch of
  the 0-based step about to be taken. Each step's skip count is read while the next step
  runs (`guard`, which stops a diverged run). A checkpoint is saved every `checkpoint_every`
  steps, at the last, when `stopper`'s clock says one is due, and before raising
  `preemption.Preempted` when a signal asked the run to stop. Returns (state, history),
  history a list of {"step", "split", **metrics} for every logged train step and evaluation."""
  def save(step, state, pending):
    guard.observe(*pending)
    save_fn(step, state)
    guard.saved(step)

  step = int(jax.device_get(state.step))
  progress = Progress(total_steps, tokens_per_step, step)
  history, skipped = [], int(jax.device_get(state.skipped))
  pending = None
  while step < total_steps:
    state, metrics = train_step(state, batch_at(step))
    step += 1
    if pending is not None:
      guard.observe(*pending)
    pending = (step, metrics["skipped_steps"])
    if due(step, log_every, total_steps) or step == 1:
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      logging.info("%s", progress.line(step, metrics))
      if metrics["skipped_steps"] > skipped:
        logging.warning("%d step(s) up to step %d had a non-finite loss or gradients; their updates were "
                        "skipped (%d in all)", metrics["skipped_steps"] - skipped, step, metrics["skipped_steps"])
        skipped = int(metrics["skipped_steps"])
      writer.write(step, metrics, "train")
      history.append({"step": step, "split": "train", **metrics})
    if evaluate_fn is not None and due(step, eval_every, total_steps):
      metrics = evaluate_fn(state)
      logging.info("eval at step %d: loss %.4f  accuracy %.3f", step, metrics["loss"],
                   metrics.get("accuracy", np.nan))
      warn_if_not_finite(f"evaluation at step {step}", metrics)
      writer.write(step, metrics, "eval")
      history.append({"step": step, "split": "eval", **metrics})
    if stopper.checkpoint(step, due(step, checkpoint_every, total_steps), lambda: save(step, state, pending)):
      pending = None
  if pending is not None:
    guard.observe(*pending)
  return state, history
