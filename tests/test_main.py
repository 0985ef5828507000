"""`python -m k25jax.main`: flags, overrides and the errors a user meets first."""
import glob
import os
import signal
import subprocess
import sys

import pytest
from cpu_env import subprocess_env

ROOT = os.path.join(os.path.dirname(__file__), "..")
MICRO = ["--config.model.num_hidden_layers=2", "--config.model.vocab_size=512", "--config.model.hidden_size=64",
         "--config.model.num_attention_heads=2", "--config.model.n_routed_experts=4",
         "--config.model.num_experts_per_tok=2", "--config.train.seq_len=16", "--config.train.steps=2",
         "--config.optimizer.warmup_steps=1", "--config.optimizer.decay_steps=1", "--config.train.eval_batches=1"]


def main(*flags, devices=1):
  """`python -m k25jax.main` on configs/pretrain.py with `flags`: runs of a step or two, so
  compiled at LLVM's quickest level (cpu_env: 27-30 -> 22 CPU-s for the override test)."""
  env = subprocess_env(devices, compile_bound=True)
  return subprocess.run([sys.executable, "-m", "k25jax.main", "--config=configs/pretrain.py", *flags],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_mesh_that_does_not_fit_the_devices_fails_clearly(tmp_path):
  result = main("--config.mesh.data=3", f"--workdir={tmp_path}", devices=2)
  assert result.returncode != 0
  assert "needs 3 devices, but 2 are available" in result.stderr


@pytest.mark.slow
def test_overrides_reach_the_run_and_it_writes_logs_and_checkpoints(tmp_path):
  result = main(*MICRO, f"--workdir={tmp_path}", "--config.train.checkpoint_every=1", devices=2)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "step 2/2" in result.stderr and "'data': 2" in result.stderr
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
  assert glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))


def test_presets_round_trip_their_model_configs():
  from k25jax.model import config as model_config
  from k25jax.train import config_utils
  from test_train_step import load_pretrain_config
  for preset in ("tiny", "small"):
    config = load_pretrain_config(preset)
    assert config.stage == "pretrain" and config.model.preset == preset
    assert config_utils.model_config_from(config.model) == model_config.preset(preset)
  with pytest.raises(ValueError, match="unknown preset"):
    load_pretrain_config("huge")


def _preemptible(workdir, *flags) -> list[str]:
  """A 100-step micro pre-training command that logs every step and saves only at its end."""
  return [sys.executable, "-m", "k25jax.main", "--config=configs/pretrain.py", *MICRO, f"--workdir={workdir}",
          "--config.train.steps=100", "--config.train.log_every=1", "--config.train.checkpoint_every=1000", *flags]


def _sigterm_after_step_3(process: subprocess.Popen) -> str:
  """Sends `process` (its stderr piped) SIGTERM once it has logged step 3; its whole stderr."""
  seen = []
  for line in process.stderr:
    seen.append(line)
    if "step 3/100" in line:
      process.send_signal(signal.SIGTERM)
      break
  return "".join(seen + process.stderr.readlines())


def _preempted_at(log: str) -> int:
  return int(log.split("preempted at step ")[1].split(":")[0])


@pytest.mark.slow
def test_sigterm_saves_logs_one_line_and_exits_143_then_the_same_command_resumes(tmp_path):
  """A real SIGTERM to `python -m k25jax.main` once it has logged step 3: it saves the step in
  flight, says so in one line and exits with preemption.EXIT_PREEMPTED; the same command then
  resumes from that checkpoint and finishes."""
  command = _preemptible(tmp_path)
  run = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stderr=subprocess.PIPE, text=True)
  log = _sigterm_after_step_3(run)
  assert run.wait(timeout=120) == 143, log[-3000:]
  stopped = [line for line in log.splitlines() if "preempted at step" in line]
  assert len(stopped) == 1 and stopped[0].endswith("; rerun the same command to resume"), log[-3000:]
  step = _preempted_at(log)
  assert 3 <= step < 100 and os.listdir(tmp_path / "checkpoints") == [str(step)]
  again = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"restored checkpoint {step}" in again.stderr and "step 100/100" in again.stderr
