"""preemption.Stopper: a signal becomes a stop at the next boundary, a second one is ignored,
the handlers are the run's only while it runs, and checkpoints fall due by a clock."""
import logging
import os
import signal

import pytest
import sigterm

from k25jax.train import preemption


def test_a_signal_is_a_request_a_second_one_is_ignored_and_the_handlers_go_back(caplog):
  before = {s: signal.getsignal(s) for s in preemption.SIGNALS}
  stopper = preemption.Stopper("/runs/x/checkpoints")
  with caplog.at_level(logging.WARNING), stopper:
    assert stopper.poll() == (False, False)
    sigterm.send()
    os.kill(os.getpid(), signal.SIGINT)       # while the stop is under way: logged, nothing else
    assert stopper.poll() == (True, False) and stopper.received == "SIGTERM"
  assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before
  messages = [r.getMessage() for r in caplog.records]
  assert any("received SIGTERM: the run saves a checkpoint at the next step boundary" in m for m in messages)
  assert any("received SIGINT again: the stop is under way" in m for m in messages)
  assert str(preemption.Preempted(12, stopper.directory)) == ("preempted at step 12: saved to /runs/x/checkpoints; "
                                                              "rerun the same command to resume")


@pytest.mark.parametrize("minutes, due_after", [(0.0, None), (2.0, 120.0)])
def test_checkpoint_minutes_makes_a_save_due_by_the_clock(minutes, due_after):
  now, saves = [1000.0], []
  stopper = preemption.Stopper("/runs/x/checkpoints", checkpoint_minutes=minutes, clock=lambda: now[0])
  save = lambda: saves.append(now[0])
  now[0] += 119.0
  assert stopper.poll() == (False, False) and stopper.checkpoint(1, False, save) is False
  now[0] += 1.0
  assert stopper.poll() == (False, due_after is not None)
  assert stopper.checkpoint(2, False, save) is (due_after is not None)
  now[0] += 60.0                                   # the interval starts again at a save
  assert stopper.poll() == (False, False) and stopper.checkpoint(3, True, save) is True
  assert saves == ([1120.0] if due_after else []) + [1180.0]


def test_a_signal_saves_at_the_boundary_then_stops_and_one_during_the_save_stops_there_too():
  saves = []
  with preemption.Stopper("/runs/x/checkpoints") as stopper:
    assert stopper.checkpoint(1, False, lambda: saves.append(1)) is False
    with pytest.raises(preemption.Preempted, match="^preempted at step 2: saved to /runs/x/checkpoints;"):
      stopper.checkpoint(2, True, lambda: (saves.append(2), sigterm.send()))
  with preemption.Stopper("/runs/x/checkpoints") as stopper:
    sigterm.send()
    with pytest.raises(preemption.Preempted, match="^preempted at step 3: "):
      stopper.checkpoint(3, False, lambda: saves.append(3))
  assert saves == [2, 3]
