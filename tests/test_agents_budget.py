"""Critical-steps accounting and budget truncation of k25jax.agents.widesearch.Episode."""
import math

import numpy as np
import pytest

from k25jax import losses
from k25jax.agents import dsl
from k25jax.agents import widesearch as ws


def test_hand_built_trace_matches_losses_critical_steps():
  trace = ws.StepTrace()
  trace.add_stage({0: 2, 3: 1})     # 1 + 2
  trace.add_stage()                 # 1
  trace.add_stage({7: 3})           # 1 + 3
  main, sub = trace.arrays()
  assert main.tolist() == [1, 1, 1] and sub.shape == (3, 8) and sub[0, 3] == 1 and sub[2, 7] == 3
  assert trace.critical_steps == 8 == float(losses.critical_steps(main, sub))
  padded_main, padded_sub = trace.arrays(num_stages=5)
  assert float(losses.critical_steps(padded_main, padded_sub)) == 8
  with pytest.raises(ValueError):
    trace.arrays(num_stages=2)
  with pytest.raises(ValueError):
    trace.add_stage({8: 1})


def test_stacked_traces_batch_into_losses_critical_steps():
  traces = []
  for stages in ([{0: 1}], [{}, {}, {1: 2, 2: 2}], []):
    traces.append(ws.StepTrace())
    for stage in stages:
      traces[-1].add_stage(stage)
  main, sub = ws.stack_traces(traces)
  assert main.shape == (3, 3) and sub.shape == (3, 3, 8)
  np.testing.assert_array_equal(np.asarray(losses.critical_steps(main, sub)), [2, 5, 0])


@pytest.mark.parametrize("n", [2, 5, 8])
def test_episode_steps_follow_the_formula_when_the_budget_is_loose(n):
  for k in range(n + 1):
    result = ws.run_episode(ws.make_task(n, kind="wide", n=n), ws.ScriptedOrchestrator(k), budget=16)
    expected = n + 1 if k == 0 else 1 + math.ceil(n / k) + 1
    main, sub = result.trace.arrays()
    assert result.critical_steps == expected == float(losses.critical_steps(main, sub))
    assert result.score.success and not result.forced
    assert sub[0].tolist() == sorted(sub[0].tolist(), reverse=True)    # slot i took its chunk's size
    assert int(sub[0].sum()) == (n if k else 0)


def test_truncation_stops_subagents_and_forces_a_partial_answer():
  task = ws.make_task(3, kind="wide", n=8)
  result = ws.run_episode(task, ws.ScriptedOrchestrator(2), budget=4)   # 4 entities each, 2 steps allowed
  assert result.critical_steps == 4 and result.forced
  assert result.trace.stages == [{0: 2, 1: 2}, {}]
  assert result.score.item_recall == 0.5 and result.score.item_precision == 1.0
  assert (result.num_assigned, result.num_finished) == (2, 0)
  assert all(t.text.count("stop") == 1 for t in result.subagents)
  assert result.orchestrator.text.split("|")[-3].strip().endswith("stop")


def test_subagent_step_cap_leaves_the_rest_to_the_orchestrator():
  task = ws.make_task(5, kind="wide", n=4)
  result = ws.run_episode(task, ws.ScriptedOrchestrator(2), budget=16, max_subagent_steps=1)
  assert result.trace.stages == [{0: 1, 1: 1}, {}, {}, {}]      # two own searches, then the answer
  assert result.score.success and result.num_finished == 0 and result.critical_steps == 5


def drive(task, turns, budget=4):
  """Runs an episode where each agent's turns are given as readable text, in order."""
  episode = ws.Episode(task, budget=budget)
  queues = {agent: list(texts) for agent, texts in turns.items()}
  while not episode.done:
    for request in episode.requests():
      episode.submit(request.agent, dsl.encode(queues[request.agent].pop(0)))
  return episode.result()


def test_agents_created_and_never_assigned_are_idle():
  task = ws.make_task(6, kind="wide", n=2)
  a = dsl.ATTRIBUTE.name(task.attribute)
  e0, e1 = (dsl.ENTITY.name(e) for e in task.entities)
  result = drive(task, {"main": [f"create searcher S1 S2 S3 assign {a} S1 {e0} {e1} |", "answer |"],
                        "S1": [f"search {a} {e0} |", f"search {a} {e1} |",
                               f"answer {e0} V{task.gold[0][1]} {e1} V{task.gold[1][1]} |"]}, budget=5)
  assert (result.num_created, result.num_assigned, result.num_finished, result.num_idle) == (3, 1, 1, 2)
  assert float(losses.r_finish(result.num_finished, result.num_assigned, result.num_idle)) == pytest.approx(1 / 3)


def test_late_assignment_fails_with_a_budget_error():
  task = ws.make_task(0, kind="wide", n=2)
  e0, e1 = (dsl.ENTITY.name(e) for e in task.entities)
  a = dsl.ATTRIBUTE.name(task.attribute)
  result = drive(task, {"main": [f"search {a} {e0} |", "search {a} |".format(a=a),
                                 f"create searcher S1 assign {a} S1 {e1} |", "answer |"]})
  assert result.errors["orch"] == {"arity": 1, "budget": 1}
  assert result.num_assigned == 0 and result.critical_steps == 4
  texts = result.orchestrator.text.split(" | ")
  assert texts[4] == "obs err search" and texts[6] == "obs err assign stop"


def test_forced_turn_without_an_answer_scores_an_empty_table():
  task = ws.make_task(1, kind="wide", n=3)
  a, e0 = dsl.ATTRIBUTE.name(task.attribute), dsl.ENTITY.name(task.entities[0])
  result = drive(task, {"main": [f"search {a} {e0} |"] * 3}, budget=3)      # the third turn is forced
  assert result.errors["orch"] == {"no_answer": 1} and result.prediction == ()
  assert result.score.item_f1 == 0.0 and result.critical_steps == 3


def test_forced_subagent_without_an_answer_returns_nothing():
  task = ws.make_task(2, kind="wide", n=2)
  a = dsl.ATTRIBUTE.name(task.attribute)
  e0, e1 = (dsl.ENTITY.name(e) for e in task.entities)
  result = drive(task, {"main": [f"create searcher S1 S2 assign {a} S1 {e0} S2 {e1} |", f"answer {e0} V0 |"],
                        "S1": [f"search {a} {e0} |", f"search {a} {e0} |", f"search {a} {e0} |"],
                        "S2": [f"answer {e1} V1 |"]})
  assert result.errors["sub"] == {"no_answer": 1}
  assert result.trace.stages == [{0: 2, 1: 0}, {}] and result.num_finished == 1
  assert result.orchestrator.text.split(" | ")[2] == f"obs {e1} V1 stop"     # only S2's rows come back


def test_truncated_turn_is_closed_by_the_environment_and_logprobs_align():
  task = ws.make_task(4, kind="wide", n=2)
  episode = ws.Episode(task, budget=4)
  prompt_length = len(episode.orchestrator.tokens)
  episode.submit("main", dsl.encode("create searcher S1"), logprobs=[-0.5, -0.25, -0.125])
  transcript = episode.orchestrator
  assert transcript.tokens[prompt_length:prompt_length + 4] == dsl.encode("create searcher S1 |")
  assert transcript.loss_mask[prompt_length:prompt_length + 4] == [1, 1, 1, 0]
  assert transcript.logprobs[prompt_length:prompt_length + 4] == [-0.5, -0.25, -0.125, 0.0]
  assert episode.errors["orch"] == {"truncated": 1} and episode.used_steps == 1
  with pytest.raises(ValueError):
    episode.submit("S1", dsl.encode("answer |"))


def test_random_token_policies_always_end_within_budget():
  rng = np.random.default_rng(0)
  def noisy(context):
    if rng.random() < 0.5:
      return ws.solo_policy(context) if context[0] == dsl.SUB_ID else ws.ScriptedOrchestrator(3)(context)
    return rng.integers(0, dsl.VOCAB_SIZE, size=int(rng.integers(1, 12))).tolist()
  num_errors = 0
  for seed in range(60):
    task = ws.make_task(seed, kind="deep" if seed % 4 == 0 else "wide")
    budget = 2 + seed % 5
    result = ws.run_episode(task, noisy, noisy, budget=budget)
    main, sub = result.trace.arrays()
    assert result.critical_steps <= budget
    assert result.critical_steps == float(losses.critical_steps(main, sub))
    assert 0.0 <= result.score.item_f1 <= 1.0
    num_errors += sum(result.errors["orch"].values()) + sum(result.errors["sub"].values())
  assert num_errors > 60
