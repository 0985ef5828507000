"""The PARL stage's config checks, its warm start, and README's first command end to end,
then the same run stopped by SIGTERM at three moments of its iterations, whose rerun ends as
the command's uninterrupted run."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import saved_states
import sigterm
from cpu_env import subprocess_env

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("field, value, message", [
    ("warm_start.delegation_share", 1.5, "warm_start.delegation_share=1.5: must be a number in [0, 1]"),
    ("warm_start.capability_share", -0.1, "warm_start.capability_share=-0.1: must be a number in [0, 1]"),
    ("warm_start.subagent_rows", -1, "warm_start.subagent_rows=-1: must be an integer >= 0"),
    ("parl.budget_range", (3, 17), "parl.budget_range=(3, 17) must be (lo, hi) with 2 <= lo <= hi <= 16"),
    ("parl.n_range", (9, 8), "parl.n_range=(9, 8) must be (lo, hi) with 1 <= lo <= hi <= 32"),
    ("parl.subagent_failure", 1.5, "parl.subagent_failure=1.5: must be a number in [0, 1]"),
    ("parl.subagent_step_cost", 0, "parl.subagent_step_cost=0: must be a positive integer")])
def test_bad_parl_fields_fail_naming_them(field, value, message):
  from configs import parl as parl_config
  from k25jax.stages import parl
  from k25jax.train import config_check
  config = parl_config.get_config()
  config_check.validate(config)
  parl.check(config)
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ValueError) as error:
    config_check.validate(config)
    parl.check(config)
  assert message in str(error.value)


def test_the_chat_switch_is_the_recipe_model_in_the_chat_rendering_and_checks_its_fields():
  from configs import common
  from configs import parl as parl_config
  from k25jax.stages import parl
  config = parl_config.get_config("tiny,chat")
  assert config.parl.rendering == "chat" and config.model.vocab_size == common.CHAT_VOCAB_SIZE
  assert {k: config.model[k] for k in common.TINY_CHAT_TEXT if k != "max_position_embeddings"} == {
      k: v for k, v in common.TINY_CHAT_TEXT.items() if k != "max_position_embeddings"}
  parl.check(config)
  config.model.vocab_size = 91
  with pytest.raises(ValueError, match="parl.rendering='chat' has 268 ids"):
    parl.check(config)
  config = parl_config.get_config("tiny,chat")
  config.warm_start.after_init = True
  with pytest.raises(ValueError, match="set init.checkpoint"):
    parl.check(config)
  with pytest.raises(ValueError, match="the single agent bans"):
    parl.policies(config, None, None, None, greedy=True, solo=True)


@pytest.mark.slow
def test_the_warm_start_after_init_fine_tunes_the_given_params(tmp_path):
  import jax
  import numpy as np
  from configs import parl as parl_config
  from k25jax.model import transformer
  from k25jax.stages import parl
  from k25jax.train import config_utils, sharding, trainer as trainer_lib
  config = parl_config.get_config("tiny,chat")
  config.warm_start.update(demonstrations=8, steps=2, batch=8, log_every=1, checkpoint_every=2, router_bias_rate=0.0)
  config.warm_start.optimizer.update(lr=1e-9, warmup_steps=1, decay_steps=1)
  config.mesh.devices = 1
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  with jax.set_mesh(mesh):
    start = trainer_lib.fresh_params(model, mesh, seed=7)
    tuned = jax.device_get(parl.builtin_warm_start(config, model, mesh, str(tmp_path), init_params=start))
    fresh = jax.device_get(trainer_lib.fresh_params(model, mesh, seed=0))
  start = jax.device_get(start)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), tuned, start)
  assert not np.allclose(tuned["embed_tokens"]["embedding"], fresh["embed_tokens"]["embedding"])




# The stops of one workdir, in order: (moment, the iteration it stops after). A run that
# resumes at iteration s sends its signal in iteration s+1's rollouts, or in its save of 4:
# the last iteration's, so the fourth run resumes with no iteration left, only the final table.
STOPS = (("mid_evaluation", 1), ("mid_step", 2), ("mid_save", 4))
# README's first command at about colab/parl.ipynb's smoke sizes, four PARL iterations (DSL
# rendering): 2 tasks x 2 episodes an iteration, 2 held-out tasks, an evaluation and a checkpoint
# every 2; a 40-step warm start (the smoke run's 10 steps score 0 on every episode, so no update
# would have an advantage to carry).
MAIN_OVERRIDES = ("warm_start.steps=40", "warm_start.demonstrations=320", "warm_start.batch=32",
                  "warm_start.checkpoint_every=40", "warm_start.optimizer.warmup_steps=2",
                  "warm_start.optimizer.decay_steps=30", "rl.prompts_per_iteration=2", "rl.num_generations=2",
                  "parl.eval_tasks=2", "parl.subagent_turn_tokens=24", "train.steps=4", "train.eval_every=2",
                  "train.checkpoint_every=2", "train.log_every=1")


def _main_config():
  """The config `python -m k25jax.main --config=configs/parl.py` builds with `MAIN_OVERRIDES`."""
  from k25jax.train import config_utils
  config = config_utils.load_config_file(os.path.join(CHECKOUT, "configs", "parl.py"))
  config_utils.apply_overrides(config, list(MAIN_OVERRIDES))
  return config


def _final_state(workdir: str) -> dict[str, np.ndarray]:
  """Every leaf of the state in the run's newest checkpoint by key path, restored onto one device."""
  import jax
  import orbax.checkpoint as ocp
  target = saved_states.one_device_target(workdir)
  return saved_states.by_key_path(ocp.PyTreeCheckpointer().restore(
      saved_states.newest_state_dir(workdir),
      args=ocp.args.PyTreeRestore(restore_args=jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding),
                                                            target))))


def _stop_and_rerun(root: str) -> None:
  """Under `root`: the main command's run stopped at each of `STOPS` and rerun (root/stopped,
  from the uninterrupted run's warm start, as a rerun of the command finds it: a stop inside a
  warm start is the supervised loop's, tested in test_train_e2e.py). Writes the steps the
  stops reported, the iterations the last rerun ran and its final table (runs.json), and both
  runs' final checkpointed states (NAME.npz)."""
  from k25jax.stages import parl
  from k25jax.train import preemption
  out = {"stops": []}
  stopped = os.path.join(root, "stopped")
  shutil.copytree(os.path.join(root, "uninterrupted", "warm_start"), os.path.join(stopped, "warm_start"))
  for moment, _ in STOPS:
    with pytest.MonkeyPatch.context() as monkeypatch:
      expected = sigterm.during_rl_iterations(monkeypatch, moment, dict(STOPS)[moment])
      try:
        parl.run(_main_config(), stopped)
        out["stops"].append([moment, expected, None])
      except preemption.Preempted as e:
        out["stops"].append([moment, expected, e.step])
  _, history = parl.run(_main_config(), stopped)
  out["stopped"] = history[-1]
  out["rerun_iterations"] = [h["iteration"] for h in history if h["split"] != "final"]
  with open(os.path.join(root, "runs.json"), "w") as f:
    json.dump(out, f)
  for name in ("uninterrupted", "stopped"):
    np.savez(os.path.join(root, f"{name}.npz"), **_final_state(os.path.join(root, name)))


def _scalars(workdir) -> dict[str, list]:
  """Every (step, value) a run logged to tensorboard, by tag, wall-clock tags aside."""
  from tensorboard.backend.event_processing import event_accumulator
  events = event_accumulator.EventAccumulator(os.path.join(workdir, "tensorboard"))
  events.Reload()
  return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
          for tag in events.Tags()["scalars"] if not sigterm.timed(tag)}


@pytest.mark.slow
def test_the_main_command_runs_and_stopped_at_three_moments_its_rerun_ends_as_the_uninterrupted_run(tmp_path):
  """README's first command end to end (`MAIN_OVERRIDES`: its summary, curves, checkpoints and
  tensorboard), then the same run stopped three times (`STOPS`: in the evaluation at iteration
  0, in iteration 2's rollouts, twice in the save of the last iteration), each stop after the
  iteration in flight and its save, then rerun to the end: its final state is bitwise the
  command's (params, optimizer, rng, counters), and so is every number the runs logged and the
  final table (wall-clock entries aside). Both processes compile at LLVM's quickest level
  (cpu_env.COMPILE_BOUND_FLAGS) on one device, the second loading the first's programs from the
  session's jax cache."""
  env = subprocess_env(compile_bound=True, PYTHONPATH=CHECKOUT)
  command = subprocess.run([sys.executable, "-m", "k25jax.main", "--config=configs/parl.py",
                            f"--workdir={tmp_path / 'uninterrupted'}", *(f"--config.{o}" for o in MAIN_OVERRIDES)],
                           cwd=CHECKOUT, env=env, capture_output=True, text=True, timeout=900)
  assert command.returncode == 0, command.stderr[-3000:]
  assert "PARL summary" in command.stdout
  for policy in ("swarm (trained), sampled", "single agent (warm start), greedy"):
    assert policy in command.stdout
  curves = json.loads((tmp_path / "uninterrupted" / "parl_curves.json").read_text())
  train = [row for row in curves if row["split"] == "train"]
  assert [row["iteration"] for row in train] == [1, 2, 3, 4]
  assert all(0.0 <= row["item_f1"] <= 1.0 and row["critical_steps"] <= 10 for row in train)   # budgets 3-10
  assert curves[-1]["rows"]["single agent (warm start), greedy"]["num_created"] == 0.0
  assert (tmp_path / "uninterrupted" / "checkpoints").is_dir() and (tmp_path / "uninterrupted" / "tensorboard").is_dir()

  out = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  runs = json.loads((tmp_path / "runs.json").read_text())
  assert [(moment, stop) for moment, _, stop in runs["stops"]] == [(m, at) for m, at in STOPS]
  assert all(expected == stop for _, expected, stop in runs["stops"])
  assert runs["rerun_iterations"] == []      # the stop in the last save left only the final table
  uninterrupted, stopped = np.load(tmp_path / "uninterrupted.npz"), np.load(tmp_path / "stopped.npz")
  assert sorted(uninterrupted) == sorted(stopped) and any("params" in key for key in uninterrupted)
  for key in uninterrupted:
    np.testing.assert_array_equal(stopped[key], uninterrupted[key], err_msg=key)
  logged = _scalars(tmp_path / "uninterrupted")
  assert {"train/reward", "train/loss", "eval/item_f1"} <= set(logged)
  assert [step for step, _ in logged["train/reward"]] == [1, 2, 3, 4] and any(r > 0 for _, r in logged["train/reward"])
  assert _scalars(tmp_path / "stopped") == logged
  assert sigterm.untimed([runs["stopped"]]) == sigterm.untimed([curves[-1]])


if __name__ == "__main__":     # ROOT: the stopped runs, for the test (at the main command's default precision)
  _stop_and_rerun(sys.argv[1])
