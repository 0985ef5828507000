"""SIGTERM to this test process at a chosen moment of a run (the preemption tests)."""
import os
import signal

from k25jax.train import checkpoint


def send() -> None:
  os.kill(os.getpid(), signal.SIGTERM)


def twice_during_save(monkeypatch, step: int) -> None:
  """Makes the run's save of `step` receive SIGTERM twice (the second while the stop is under
  way) before it writes."""
  save = checkpoint.Checkpoints.save

  def save_with_signals(self, saved_step, *args):
    if saved_step == step:
      send()
      send()
    save(self, saved_step, *args)

  monkeypatch.setattr(checkpoint.Checkpoints, "save", save_with_signals)
