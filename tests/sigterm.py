"""SIGTERM to this test process at a chosen moment of a run (the preemption tests)."""
import os
import signal

from k25jax.rl import driver
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


def during_rl_iterations(monkeypatch, moment: str, iteration: int = 2) -> int:
  """Sends this process SIGTERM while `iteration` of the RL driver (`driver.train`: the RL and
  PARL stages) collects its rollouts ("mid_step"), during the run's first evaluation, at
  iteration 0 ("mid_evaluation"), or twice during the save of `iteration` ("mid_save");
  returns the iteration the run must stop after."""
  if moment == "mid_save":
    twice_during_save(monkeypatch, iteration)
    return iteration
  train = driver.train

  def train_with_signal(trainer, state, config, *, collect, evaluate, **kw):
    def collect_with_signal(params, index):
      if index + 1 == iteration:
        send()
      return collect(params, index)

    def evaluate_with_signal(params):
      send()
      return evaluate(params)

    if moment == "mid_step":
      return train(trainer, state, config, collect=collect_with_signal, evaluate=evaluate, **kw)
    return train(trainer, state, config, collect=collect, evaluate=evaluate_with_signal, **kw)

  monkeypatch.setattr(driver, "train", train_with_signal)
  return iteration if moment == "mid_step" else 1


def timed(name: str) -> bool:
  """Whether a logged number is a wall-clock one (`*_s`, `*per_s`), which no rerun repeats."""
  return name.endswith(("_s", "per_s"))


def untimed(rows: list[dict]) -> list[dict]:
  """History rows without their wall-clock entries (`timed`), nested rows included."""
  strip = lambda row: {k: strip(v) if isinstance(v, dict) else v for k, v in row.items() if not timed(k)}
  return [strip(row) for row in rows]
