"""k25jax.agents.widesearch: tasks, the deep chain, scripted policies, context lengths, demos."""
import math

import numpy as np
import pytest

from k25jax.agents import dsl, tools
from k25jax.agents import widesearch as ws


def test_tasks_are_deterministic_given_seed():
  a, b = ws.sample_tasks(20, seed=5, deep_fraction=0.5), ws.sample_tasks(20, seed=5, deep_fraction=0.5)
  assert [(t.kind, t.attribute, t.entities) for t in a] == [(t.kind, t.attribute, t.entities) for t in b]
  assert all(np.array_equal(x.table, y.table) for x, y in zip(a, b))
  c = ws.sample_tasks(20, seed=6, deep_fraction=0.5)
  assert [t.entities for t in a] != [t.entities for t in c]
  assert {t.kind for t in a} == {"wide", "deep"}


def test_wide_tasks_ask_distinct_entities_in_range():
  sizes = set()
  for task in ws.sample_tasks(200, seed=0):
    assert task.kind == "wide" and len(set(task.entities)) == len(task.entities)
    assert task.gold == tuple((e, int(task.table[e, task.attribute])) for e in task.entities)
    sizes.add(len(task.entities))
  assert sizes == set(range(2, 9))


@pytest.mark.parametrize("seed", range(10))
def test_deep_chain_links_each_lookup_to_the_previous_value(seed):
  task = ws.make_task(seed, kind="deep", hops=2 + seed % 4)
  gold = task.gold
  assert len(gold) == 2 + seed % 4 and gold[0][0] == task.entities[0]
  for (entity, value), (following, _) in zip(gold, gold[1:]):
    assert value == task.lookup(entity, task.attribute) and following == value   # Vk names Ek
  assert gold[-1][1] == ws.TERMINAL_VALUE and len({e for e, _ in gold}) == len(gold)
  assert ws.follow_chain(task.table, task.attribute, task.entities[0]) == gold


def test_deep_tasks_reward_not_parallelising():
  task = ws.make_task(11, kind="deep", hops=3)
  alone = ws.run_episode(task, ws.ScriptedOrchestrator(0), budget=4)
  delegated = ws.run_episode(task, ws.ScriptedOrchestrator(1), budget=4)
  assert alone.score.success and alone.critical_steps == 4
  assert delegated.score.item_recall == pytest.approx(2 / 3) and delegated.critical_steps == 4
  loose = ws.run_episode(task, ws.ScriptedOrchestrator(1), budget=10)
  assert loose.score.success and loose.critical_steps == 5 and loose.num_finished == 1


def test_scripted_policies_solve_every_wide_split_when_the_budget_allows():
  for n in range(2, 9):
    task = ws.make_task(100 + n, kind="wide", n=n)
    for k in range(n + 1):
      needed = n + 1 if k == 0 else math.ceil(n / k) + 2
      result = ws.run_episode(task, ws.ScriptedOrchestrator(k), budget=needed)
      assert result.score.success and result.errors == {"orch": {}, "sub": {}}
      assert result.num_finished == result.num_assigned == min(k, n)


@pytest.mark.parametrize("n", [4, 8])
def test_scripted_policies_get_partial_f1_when_truncated(n):
  task = ws.make_task(7, kind="wide", n=n)
  for k in range(n + 1):
    result = ws.run_episode(task, ws.ScriptedOrchestrator(k), budget=4)
    per_agent = [len(c) for c in np.array_split(np.arange(n), k)] if k else []
    answered = min(n, 3) if k == 0 else sum(min(size, 2) for size in per_agent)
    assert result.score.item_precision == 1.0
    assert result.score.item_recall == pytest.approx(answered / n)
    assert result.score.success == (answered == n) and result.critical_steps <= 4


def test_contexts_fit_the_tiny_length_at_the_widest_task():
  longest = 0
  for seed in range(5):
    task = ws.make_task(seed, kind="wide", n=8)
    for k in range(9):
      result = ws.run_episode(task, ws.ScriptedOrchestrator(k), budget=ws.DEFAULT_BUDGET)
      longest = max([longest, len(result.orchestrator.tokens)] + [len(t.tokens) for t in result.subagents])
  for hops in (2, 3, 4):
    for k in (0, 1):
      result = ws.run_episode(ws.make_task(hops, kind="deep", hops=hops), ws.ScriptedOrchestrator(k))
      longest = max([longest, len(result.orchestrator.tokens)] + [len(t.tokens) for t in result.subagents])
  assert 70 <= longest <= ws.MAX_CONTEXT == 80


def test_demonstrations_are_deterministic_and_varied():
  a, b = ws.demonstrations(40, seed=1), ws.demonstrations(40, seed=1)
  assert a.keys() == b.keys() and all(np.array_equal(a[key], b[key]) for key in a)
  assert not np.array_equal(a["tokens"], ws.demonstrations(40, seed=2)["tokens"])
  prefix = ws.demonstrations(10, seed=1)
  assert np.array_equal(prefix["tokens"], a["tokens"][:len(prefix["tokens"])])
  assert a["tokens"].shape[1] == ws.MAX_CONTEXT and set(a["role"].tolist()) == {0, 1}
  assert np.bincount(a["role"])[0] == 40 and a["episode"].max() == 39
  assert len(set(a["num_subagents"].tolist())) >= 4
  assert 0.0 < a["item_f1"].min() < 1.0 == a["item_f1"].max()        # truncated and solved episodes
  assert a["critical_steps"].max() <= ws.DEFAULT_BUDGET


def _segments(mask_row):
  """(start, end) of each run of 1s."""
  padded = np.concatenate([[0], mask_row, [0]])
  edges = np.flatnonzero(np.diff(padded))
  return list(zip(edges[0::2], edges[1::2]))


def test_demonstration_loss_masks_cover_exactly_the_policy_turns():
  demos = ws.demonstrations(24, seed=3)
  for row in range(len(demos["role"])):
    tokens, mask, length = demos["tokens"][row], demos["loss_mask"][row], demos["length"][row]
    assert tokens[0] == (dsl.SUB_ID if demos["role"][row] else dsl.ORCH_ID)
    assert not mask[length:].any() and not (tokens[length:] != dsl.PAD_ID).any()
    segments = _segments(mask)
    assert segments and segments[-1][1] == length            # a context ends with the agent's answer turn
    for start, end in segments:
      turn = tokens[start:end].tolist()
      assert turn[0] in dsl.TOOL_IDS and turn[-1] == dsl.EOT_ID and turn.count(dsl.EOT_ID) == 1
      if demos["role"][row] == 1:
        policy = ws.solo_policy
      else:
        policy = ws.ScriptedOrchestrator(int(demos["num_subagents"][demos["episode"][row]]))
      assert turn == policy(tokens[:start].tolist())         # the scripted agent wrote exactly this turn
      assert tools.parse_turn(turn, role="orch").errors == ()
    unmasked = tokens[:length][mask[:length] == 0].tolist()
    assert not any(t in dsl.TOOL_IDS for t in unmasked)     # prompt and observations only (no errors here)
    blocks = dsl.decode(unmasked).split(" | ")
    assert all(block.split()[0] == "obs" for block in blocks[1:] if block)


def test_demonstrations_reject_contexts_over_the_limit():
  with pytest.raises(ValueError, match="max_length"):
    ws.demonstrations(8, seed=0, max_length=20)
