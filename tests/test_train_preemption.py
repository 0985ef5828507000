"""preemption.Stopper: a signal becomes a stop at the next boundary, a second one is ignored,
the handlers are the run's only while it runs, and checkpoints fall due by a clock."""
import logging
import os
import signal

import pytest

from k25jax.train import preemption


def test_a_signal_is_a_request_a_second_one_is_ignored_and_the_handlers_go_back(caplog):
  before = {s: signal.getsignal(s) for s in preemption.SIGNALS}
  stopper = preemption.Stopper("/runs/x/checkpoints")
  with caplog.at_level(logging.WARNING), stopper:
    assert stopper.poll() == (False, False)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)       # while the stop is under way: logged, nothing else
    assert stopper.poll() == (True, False) and stopper.received == "SIGTERM"
  assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before
  messages = [r.getMessage() for r in caplog.records]
  assert any("received SIGTERM: the run saves a checkpoint at the next step boundary" in m for m in messages)
  assert any("received SIGINT again: the stop is under way" in m for m in messages)
  assert str(stopper.stop(12)) == ("preempted at step 12: saved to /runs/x/checkpoints; "
                                   "rerun the same command to resume")


@pytest.mark.parametrize("minutes, due_after", [(0.0, None), (2.0, 120.0)])
def test_checkpoint_minutes_makes_a_save_due_by_the_clock(minutes, due_after):
  now = [1000.0]
  stopper = preemption.Stopper("/runs/x/checkpoints", checkpoint_minutes=minutes, clock=lambda: now[0])
  now[0] += 119.0
  assert stopper.poll() == (False, False)
  now[0] += 1.0
  assert stopper.poll() == (False, due_after is not None)
  assert stopper.saved() is False                  # the interval starts again at a save
  now[0] += 60.0
  assert stopper.poll() == (False, False)
