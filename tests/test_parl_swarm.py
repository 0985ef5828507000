"""The swarm runtime and the PARL stage's pieces: batching, batch-invariance, loss masks, rewards."""
import jax
import numpy as np
import pytest

from config_files import load_config
from k25jax.agents import dsl, swarm, widesearch
from k25jax.model import transformer
from k25jax.rl import rollout
from k25jax.stages import parl
from k25jax.train import config_utils


@pytest.fixture(scope="module")
def setup():
  config = load_config("configs/parl.py")
  config.model.update(hidden_size=32, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=32,
                      q_lora_rank=16, kv_lora_rank=16, v_head_dim=8, initializer_range=0.5)
  model_cfg = config_utils.model_config_from(config.model)
  params = transformer.init_params(model_cfg, jax.random.PRNGKey(0))
  return config, model_cfg, params


def _texts(results):
  return [[r.orchestrator.text] + [t.text for t in r.subagents] for r in results]


@pytest.mark.slow
def test_batched_swarm_decodes_like_each_episode_alone(setup):
  config, model_cfg, params = setup
  tasks = widesearch.sample_tasks(6, seed=3, deep_fraction=0.3)
  together, runtime, _ = parl.play(config, model_cfg, params, params, tasks, greedy=True)
  alone = [parl.play(config, model_cfg, params, params, [t], greedy=True)[0][0] for t in tasks]
  assert _texts(together) == _texts(alone)
  assert runtime.device_calls["orch"] < sum(runtime.decoded_rows.values())


@pytest.mark.slow
def test_sixteen_subagents_cost_about_one_device_call_per_stage(setup):
  """A scripted orchestrator spawns k sub-agents per episode; the frozen model decodes them in
  batches: one call per sub-agent step of the stage, or (CPU's default) one per 32 of its rows,
  shortest contexts first, with the same turns."""
  config, model_cfg, params = setup
  policies = parl.policies(config, model_cfg, params, params, greedy=True)
  tasks = widesearch.sample_tasks(16, seed=0, n_range=(8, 8))
  # The orchestrators are scripted (k = 8 sub-agents each), the sub-agents are the model.
  runs = {}
  for max_rows in (None, 1024):
    runtime = swarm.Swarm({"orch": widesearch.ScriptedOrchestrator(8), "sub": policies["sub"]}, max_rows=max_rows)
    runs[max_rows] = runtime, runtime.run([widesearch.Episode(t, budget=4) for t in tasks])
  runtime, results = runs[1024]
  spawned = sum(r.num_created for r in results)
  assert spawned == 16 * 8
  assert runtime.decoded_rows["sub"] >= spawned
  # one call per sub-agent step of the stage (budget 4 → at most 2 steps + the answer turn)
  assert runtime.device_calls["sub"] <= 3
  chunked, chunked_results = runs[None]
  assert chunked.max_rows == swarm.CPU_MAX_ROWS == 32
  assert chunked.decoded_rows["sub"] == runtime.decoded_rows["sub"]
  assert chunked.device_calls["sub"] <= 3 * 128 // 32
  assert _texts(chunked_results) == _texts(results)


def test_only_orchestrator_generated_tokens_carry_loss():
  tasks = widesearch.sample_tasks(4, seed=1, n_range=(4, 6))
  results = [widesearch.run_episode(t, widesearch.ScriptedOrchestrator(2)) for t in tasks]
  batch = rollout.loss_rows([r.orchestrator for r in results], seq_len=96, pad_id=dsl.PAD_ID)   # as parl collects them
  for i, r in enumerate(results):
    t = r.orchestrator
    n = len(t.tokens)
    np.testing.assert_array_equal(batch["mask"][i, :n - 1], t.loss_mask[1:])
    assert batch["mask"][i].sum() == sum(t.loss_mask)
    # the sub-agents' answers reach the orchestrator as observations: tokens inside `obs ... |` blocks
    obs = dsl.token_id("obs")
    inside, positions = False, []
    for j, tok in enumerate(t.tokens):
      inside = inside or tok == obs
      if inside:
        positions.append(j)
      if tok == dsl.EOT_ID:
        inside = False
    assert positions and all(batch["mask"][i, j - 1] == 0 for j in positions if j > 0)
  assert sum(len(t.tokens) for r in results for t in r.subagents) > 0  # sub-agents did work, none of it is trained


def test_rewards_anneal_the_shaping_terms(setup):
  config = setup[0]
  tasks = widesearch.sample_tasks(3, seed=2, n_range=(6, 6))
  results = [widesearch.run_episode(t, widesearch.ScriptedOrchestrator(k)) for t, k in zip(tasks, (0, 3, 6))]
  early, parts = parl.rewards(config, 0, results)
  late, late_parts = parl.rewards(config, config.parl.anneal_steps, results)
  f1 = np.array([r.score.item_f1 for r in results])
  np.testing.assert_allclose(late, f1, rtol=1e-6)                  # λ1 = λ2 = 0 at the end
  assert parts["lambda1"] == pytest.approx(config.parl.lambda1) and late_parts["lambda1"] == 0.0
  bonus = early - f1                                                 # λ1 r_parallel + λ2 r_finish
  assert abs(bonus[0]) < 1e-6 and bonus[2] >= config.parl.lambda1 - 1e-6   # spawning pays while λ1 > 0


def test_single_episode_groups_are_refused():
  config = load_config("configs/parl.py")
  config.rl.num_generations = 1
  with pytest.raises(ValueError, match="num_generations"):
    parl.check(config)
