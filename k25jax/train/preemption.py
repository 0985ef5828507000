"""Stopping on SIGTERM / SIGINT at a step boundary, and checkpoints by wall-clock time.

A scheduler stops a job with SIGTERM and a grace period (Cloud TPU maintenance, spot VMs and
GKE give about 30 s; SLURM sends it before the time limit), a user with Ctrl-C (SIGINT).
Inside a `Stopper` either signal is a request, not an interruption: the step, evaluation or
save in flight finishes, then at the next step boundary the training loop saves a checkpoint
(the state, the data iterator's position; RL's iteration is the state's step) and raises
`Preempted`. `python -m k25jax.main` then logs one line

    preempted at step N: saved to DIR; rerun the same command to resume

and exits with EXIT_PREEMPTED = 143 (128 + SIGTERM, the status a shell gives a job SIGTERM
ended), which a scheduler tells from success (0), a bad config (2) and a failure (1). A signal
that arrives while the stop is under way is logged and ignored, so the save is never cut;
SIGKILL still stops a run at once (the checkpoints' digests and quarantine cover that).

Time-based checkpoints: with `train.checkpoint_minutes` = m > 0 a checkpoint is also due when
m minutes have passed since the last save (or the start), whichever of it and
`checkpoint_every` comes first.

Several processes save the same step: at each boundary `poll` gathers every process's two
flags (a signal received; the clock past `checkpoint_minutes`) and all of them act on the
signals of any process and on process 0's clock.
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Callable

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

EXIT_PREEMPTED = 143
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
  """The run stopped on a signal after saving `step` to `directory`."""

  def __init__(self, step: int, directory: str):
    super().__init__(f"preempted at step {step}: saved to {directory}; rerun the same command to resume")
    self.step, self.directory = step, directory


class Stopper:
  """The signal handlers of one run (a context manager: installed on entry, the previous ones
  back on exit; only the main thread can install them, elsewhere a signal keeps its usual
  effect) and its time-based checkpoints."""

  def __init__(self, directory: str, checkpoint_minutes: float = 0.0, clock: Callable[[], float] = time.monotonic):
    self.directory, self.interval, self.clock = directory, 60.0 * checkpoint_minutes, clock
    self.received: str | None = None
    self.last_save = clock()
    self._previous = {}

  def __enter__(self) -> "Stopper":
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _handle(self, signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if self.received is None:
      self.received = name
      logging.warning("received %s: the run saves a checkpoint at the next step boundary and stops", name)
    else:
      logging.warning("received %s again: the stop is under way (the save in flight finishes first)", name)

  def poll(self) -> tuple[bool, bool]:
    """(stop, save): at a step boundary, whether any process received a signal, and whether
    process 0's clock says a time-based checkpoint is due; the same answer on every process."""
    flags = np.array([self.received is not None, 0 < self.interval <= self.clock() - self.last_save], np.int32)
    if jax.process_count() > 1:
      gathered = np.asarray(multihost_utils.process_allgather(flags))
      if gathered[:, 0].max() and self.received is None:
        logging.warning("another process received a signal: this one saves with it and stops")
      flags = np.array([gathered[:, 0].max(), gathered[0, 1]])
    return bool(flags[0]), bool(flags[1])

  def checkpoint(self, step: int, due: bool, save: Callable[[], None]) -> bool:
    """The boundary after step `step` (every process calls it at every step): calls `save()`
    when `due` (the run's own cadence), when the clock says a checkpoint is due or when a
    signal asked the run to stop, and then raises `Preempted` if one did, before or during
    that save, on any process (the save just made is its checkpoint). Returns whether it saved."""
    stop, clock_due = self.poll()
    if not (due or clock_due or stop):
      return False
    save()
    self.last_save = self.clock()
    if self.poll()[0]:
      raise Preempted(step, self.directory)
    return True
