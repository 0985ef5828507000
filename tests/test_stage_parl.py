"""The PARL stage's config checks, its warm start, and a run stopped by SIGTERM at three
moments of its iterations that ends as the uninterrupted run (the main command end to end
runs in tests/test_notebooks.py, after parl.ipynb, whose compiled programs it loads)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import sigterm
from cpu_env import subprocess_env

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("field, value, message", [
    ("warm_start.delegation_share", 1.5, "warm_start.delegation_share=1.5: must be a number in [0, 1]"),
    ("warm_start.capability_share", -0.1, "warm_start.capability_share=-0.1: must be a number in [0, 1]"),
    ("warm_start.subagent_rows", -1, "warm_start.subagent_rows=-1: must be an integer >= 0"),
    ("parl.budget_range", (3, 17), "parl.budget_range=(3, 17) must be (lo, hi) with 2 <= lo <= hi <= 16"),
    ("parl.n_range", (9, 8), "parl.n_range=(9, 8) must be (lo, hi) with 1 <= lo <= hi <= 32")])
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


def _preemption_config():
  """Four PARL iterations (DSL rendering) at about colab/parl.ipynb's smoke sizes: 2 tasks x 2
  episodes an iteration, 2 held-out tasks, an evaluation and a checkpoint every 2; a 40-step
  warm start (the smoke run's 10 steps score 0 on every episode, so no update would have an
  advantage to carry)."""
  from configs import parl as parl_config
  config = parl_config.get_config("tiny")
  config.warm_start.update(steps=40, demonstrations=320, batch=32, checkpoint_every=40)
  config.warm_start.optimizer.update(warmup_steps=2, decay_steps=30)
  config.rl.update(prompts_per_iteration=2, num_generations=2)
  config.parl.update(eval_tasks=2, subagent_turn_tokens=24)
  config.train.update(steps=4, eval_every=2, checkpoint_every=2, log_every=1)
  return config


def _flat_state(state) -> dict[str, np.ndarray]:
  import jax
  leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(state))
  return {jax.tree_util.keystr(path): np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
      getattr(x, "dtype", None), jax.dtypes.prng_key) else x) for path, x in leaves}


def _run_both(root: str) -> None:
  """Under `root`: the uninterrupted run (root/uninterrupted) and the same command stopped at
  each of `STOPS` and rerun (root/stopped, from the uninterrupted run's warm start, as a
  rerun of the command finds it: a stop inside a warm start is the supervised loop's, tested
  in test_train_e2e.py). Writes each run's final state (NAME.npz), its final table and the
  steps the stops reported (runs.json)."""
  from k25jax.stages import parl
  from k25jax.train import preemption
  out = {"stops": []}
  state, history = parl.run(_preemption_config(), os.path.join(root, "uninterrupted"))
  np.savez(os.path.join(root, "uninterrupted.npz"), **_flat_state(state))
  out["uninterrupted"] = history[-1]
  stopped = os.path.join(root, "stopped")
  shutil.copytree(os.path.join(root, "uninterrupted", "warm_start"), os.path.join(stopped, "warm_start"))
  for moment, _ in STOPS:
    with pytest.MonkeyPatch.context() as monkeypatch:
      expected = sigterm.during_rl_iterations(monkeypatch, moment, dict(STOPS)[moment])
      try:
        parl.run(_preemption_config(), stopped)
        out["stops"].append([moment, expected, None])
      except preemption.Preempted as e:
        out["stops"].append([moment, expected, e.step])
  state, history = parl.run(_preemption_config(), stopped)
  np.savez(os.path.join(root, "stopped.npz"), **_flat_state(state))
  out["stopped"] = history[-1]
  out["rerun_iterations"] = [h["iteration"] for h in history if h["split"] != "final"]
  with open(os.path.join(root, "runs.json"), "w") as f:
    json.dump(out, f)


def _scalars(workdir) -> dict[str, list]:
  """Every (step, value) a run logged to tensorboard, by tag, wall-clock tags aside."""
  from tensorboard.backend.event_processing import event_accumulator
  events = event_accumulator.EventAccumulator(os.path.join(workdir, "tensorboard"))
  events.Reload()
  return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
          for tag in events.Tags()["scalars"] if not sigterm.timed(tag)}


@pytest.mark.slow
def test_sigterm_at_three_moments_then_the_rerun_ends_as_the_uninterrupted_run(tmp_path):
  """One workdir stopped three times (`STOPS`: in the evaluation at iteration 0, in iteration
  2's rollouts, twice in the save of the last iteration), each stop after the iteration in
  flight and its save, then rerun to the end: its final state is bitwise the uninterrupted
  run's (params, optimizer, rng, counters), and so is every number the four runs logged and
  the final table (wall-clock entries aside). Both runs go in a one-device process at LLVM's
  quickest level (cpu_env.COMPILE_BOUND_FLAGS), as the recipe chain does."""
  out = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=900,
                       env=subprocess_env(compile_bound=True, PYTHONPATH=CHECKOUT))
  assert out.returncode == 0, out.stderr[-3000:]
  runs = json.loads((tmp_path / "runs.json").read_text())
  assert [(moment, stop) for moment, _, stop in runs["stops"]] == [(m, at) for m, at in STOPS]
  assert all(expected == stop for _, expected, stop in runs["stops"])
  assert runs["rerun_iterations"] == []      # the stop in the last save left only the final table
  uninterrupted, stopped = np.load(tmp_path / "uninterrupted.npz"), np.load(tmp_path / "stopped.npz")
  assert sorted(uninterrupted) == sorted(stopped)
  for key in uninterrupted:
    np.testing.assert_array_equal(stopped[key], uninterrupted[key], err_msg=key)
  logged = _scalars(tmp_path / "uninterrupted")
  assert {"train/reward", "train/loss", "eval/item_f1"} <= set(logged)
  assert [step for step, _ in logged["train/reward"]] == [1, 2, 3, 4] and any(r > 0 for _, r in logged["train/reward"])
  assert _scalars(tmp_path / "stopped") == logged
  assert sigterm.untimed([runs["stopped"]]) == sigterm.untimed([runs["uninterrupted"]])


if __name__ == "__main__":     # the two runs, for the test
  import jax
  jax.config.update("jax_default_matmul_precision", "highest")
  _run_both(sys.argv[1])
