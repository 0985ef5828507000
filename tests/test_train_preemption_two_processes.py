"""Two processes (jax.distributed over localhost, 2 CPU devices each) through the pre-training
stage: time-based checkpoints follow process 0's clock on both, SIGTERM to one process stops
both at one step, and the rerun of both ends bitwise as the uninterrupted run.

The test runs this file as a script in two processes; each writes what it saw to
ROOT/process_<id>.json and the test compares them (python tests/this.py ROOT PORT ID)."""
import json
import os
import subprocess
import sys

import pytest
from cpu_env import compile_once_for_both_processes, free_port, subprocess_env

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, STEP_SECONDS, CHECKPOINT_MINUTES = 12, 50.0, 2.0   # process 0's clock: a save due every 3rd step
SIGNAL_IN_STEP = 5                                          # process 1 signals itself inside this step


def _config():
  from test_train_step import micro_config
  config = micro_config()
  config.train.update(steps=STEPS, batch=8, seq_len=16, log_every=1, eval_every=6, eval_batches=1,
                      checkpoint_every=1000, checkpoint_minutes=CHECKPOINT_MINUTES, keep_checkpoints=20)
  config.mesh.update(data=2, fsdp=2)               # the 4 devices of both processes
  return config


def _run_process(root: str, port: int, process_id: int) -> None:
  """This process's part: the uninterrupted run, the run process 1 signals inside step
  `SIGNAL_IN_STEP`, and its rerun; each under a clock of its own per process (process 0's
  advances `STEP_SECONDS` a step, process 1's never moves) and with its saves recorded."""
  import jax
  compile_once_for_both_processes()
  jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
  jax.config.update("jax_default_matmul_precision", "highest")
  import sigterm
  from k25jax.stages import pretrain
  from k25jax.train import checkpoint, preemption, trainer as trainer_lib
  steps_taken, saves = [0], []
  clock = (lambda: STEP_SECONDS * steps_taken[0]) if process_id == 0 else (lambda: 0.0)

  def patch(monkeypatch, signal_in_step: int | None) -> None:
    stopper_init, fit, save = preemption.Stopper.__init__, trainer_lib.Trainer.fit, checkpoint.Checkpoints.save
    monkeypatch.setattr(preemption.Stopper, "__init__",
                        lambda self, directory, minutes=0.0: stopper_init(self, directory, minutes, clock=clock))

    def fit_counting_steps(self, state, train_step, *args, **kw):
      def step(s, batch):
        steps_taken[0] += 1
        if steps_taken[0] == signal_in_step:
          sigterm.send()
        return train_step(s, batch)
      return fit(self, state, step, *args, **kw)

    monkeypatch.setattr(trainer_lib.Trainer, "fit", fit_counting_steps)
    monkeypatch.setattr(checkpoint.Checkpoints, "save", lambda self, step, *a: (saves.append(step), save(self, step, *a)))

  def run(name: str, signal_in_step: int | None = None) -> dict:
    steps_taken[0] = 0
    saves.clear()
    with pytest.MonkeyPatch.context() as monkeypatch:
      patch(monkeypatch, signal_in_step)
      try:
        state, history = pretrain.run(_config(), os.path.join(root, name))
      except preemption.Preempted as e:
        return {"saves": list(saves), "stopped_at": e.step}
    return {"saves": list(saves), "digests": checkpoint.digests(state), "history": history}

  seen = {"uninterrupted": run("uninterrupted"),
          "stopped": run("stopped", SIGNAL_IN_STEP if process_id == 1 else None),
          "rerun": run("stopped")}
  with open(os.path.join(root, f"process_{process_id}.json"), "w") as f:
    json.dump(seen, f)


@pytest.mark.slow
def test_both_processes_save_on_process_0s_clock_stop_together_and_resume_bitwise(tmp_path):
  port = free_port()
  processes = [subprocess.Popen([sys.executable, __file__, str(tmp_path), str(port), str(pid)],
                                env=subprocess_env(2, PYTHONPATH=CHECKOUT), stderr=subprocess.PIPE, text=True)
               for pid in (0, 1)]
  logs = [p.communicate(timeout=600)[1] for p in processes]
  assert [p.returncode for p in processes] == [0, 0], "\n".join(log[-3000:] for log in logs)
  first, second = (json.loads((tmp_path / f"process_{pid}.json").read_text()) for pid in (0, 1))
  # Time-based saves: every 3rd step by process 0's clock (150 s >= 2 min), and the last; process
  # 1's clock never moved, yet it saved the same steps.
  assert first["uninterrupted"]["saves"] == second["uninterrupted"]["saves"] == [3, 6, 9, 12]
  # SIGTERM to process 1 only: both save the step in flight (after the clock's save at 3) and stop.
  assert first["stopped"] == second["stopped"] == {"saves": [3, SIGNAL_IN_STEP], "stopped_at": SIGNAL_IN_STEP}
  assert "another process received a signal: this one saves with it and stops" in logs[0]
  assert "received SIGTERM" in logs[1]
  # The rerun of both resumes at that step (its first logged step is the next) and ends as the
  # uninterrupted run: every array's digest (params, optimizer, rng, counters), every logged number.
  for seen in (first, second):
    assert seen["rerun"]["digests"] == seen["uninterrupted"]["digests"]
    assert seen["rerun"]["history"] == [h for h in seen["uninterrupted"]["history"] if h["step"] > SIGNAL_IN_STEP]
  assert first["rerun"]["digests"] == second["rerun"]["digests"]


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  _run_process(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
