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


def test_wide_tasks_ask_distinct_entities_in_range_with_budgets_drawn_per_task():
  sizes, budgets = set(), set()
  for task in ws.sample_tasks(300, seed=0):
    assert task.kind == "wide" and len(set(task.entities)) == len(task.entities)
    assert task.gold == tuple((e, int(task.table[e, task.attribute])) for e in task.entities)
    sizes.add(len(task.entities))
    budgets.add(task.budget)
  assert sizes == set(range(ws.N_RANGE[0], ws.N_RANGE[1] + 1)) and ws.N_RANGE == (2, 24)
  assert budgets == set(range(ws.BUDGET_RANGE[0], ws.BUDGET_RANGE[1] + 1))
  same = ws.sample_tasks(300, seed=0, budget_range=(5, 5))        # the budget has its own random stream
  assert [t.entities for t in same] == [t.entities for t in ws.sample_tasks(300, seed=0)]
  assert {t.budget for t in same} == {5}


def test_prompts_show_the_budget_and_the_task_but_no_kind_or_role_hint():
  wide, deep = ws.make_task(3, kind="wide", n=3, budget=7), ws.make_task(3, kind="deep", hops=3, budget=5)
  a, entities = dsl.ATTRIBUTE.name(wide.attribute), " ".join(dsl.ENTITY.name(e) for e in wide.entities)
  assert dsl.decode(wide.prompt()) == f"orch B7 {a} {entities} |"
  assert dsl.decode(deep.prompt()) == f"orch B5 chain {dsl.ATTRIBUTE.name(deep.attribute)} {dsl.ENTITY.name(deep.entities[0])} |"
  for task in ws.sample_tasks(50, seed=1, deep_fraction=0.5):
    assert not set(task.prompt()) & dsl.SYSTEM_IDS                # no searcher / follower in the task
  episode = ws.Episode(wide, budget=12)                             # an episode's budget is the one shown
  assert dsl.decode(episode.orchestrator.tokens[:2]) == "orch B12" and episode.task.budget == 12
  view = tools.read_context(deep.prompt())
  assert (view.role, view.budget, view.chain, view.system_prompt) == ("orch", 5, True, None)
  with pytest.raises(ValueError, match="budget"):
    ws.make_task(0, budget=17)


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


def _submit(episode, agent, text):
  episode.submit(agent, dsl.encode(text))


def test_assign_all_splits_what_the_orchestrator_has_not_observed_and_answer_all_returns_it():
  task = ws.make_task(4, kind="wide", n=5, budget=10)
  e = [dsl.ENTITY.name(x) for x in task.entities]
  a = dsl.ATTRIBUTE.name(task.attribute)
  episode = ws.Episode(task)
  _submit(episode, "main", f"search {a} {e[1]} |")
  _submit(episode, "main", f"create searcher S1 S2 S3 S4 S5 assign {a} S1 S2 S3 S4 S5 all |")
  prompts = [dsl.decode(r.context) for r in episode.requests()]    # 4 left after E1's own lookup
  assert prompts == [f"sub searcher {a} {e[0]} |", f"sub searcher {a} {e[2]} |", f"sub searcher {a} {e[3]} |",
                     f"sub searcher {a} {e[4]} |"]
  assert episode.errors["orch"] == {"nothing_left": 1}                 # S5's share was empty: it stays idle
  for request in episode.requests():
    entity = dsl.decode(request.context).split()[3]
    _submit(episode, request.agent, f"search {a} {entity} |")
    _submit(episode, request.agent, "answer all |")
  _submit(episode, "main", "answer all |")
  result = episode.result()
  assert result.score.success and set(result.prediction) == set(task.gold)
  assert (result.num_created, result.num_assigned, result.num_finished, result.num_idle) == (5, 4, 4, 1)


def test_search_next_looks_up_what_its_agent_still_needs_in_order():
  task = ws.make_task(6, kind="wide", n=3, budget=10)
  a = dsl.ATTRIBUTE.name(task.attribute)
  episode = ws.Episode(task)
  _submit(episode, "main", f"search {a} {dsl.ENTITY.name(task.entities[1])} |")     # out of order, by name
  for _ in range(3):
    _submit(episode, "main", f"search {a} next |")
  observed = [row for row in tools.read_context(episode.orchestrator.tokens).found]
  assert observed == [task.gold[1], task.gold[0], task.gold[2]]
  assert episode.errors["orch"] == {"nothing_left": 1}                  # the third `next` had nothing left
  deep = ws.make_task(3, kind="deep", hops=4, budget=12)
  result = ws.run_episode(deep, lambda c: dsl.encode(f"search {dsl.ATTRIBUTE.name(deep.attribute)} next |")
                          if ws.remaining(tools.read_context(c)) else dsl.encode("answer all |"))
  assert result.prediction == deep.gold and result.critical_steps == 5   # `next` follows the chain


def test_assign_all_on_a_chain_continues_from_the_last_value_observed():
  task = ws.make_task(2, kind="deep", hops=4, budget=12)
  gold, a = task.gold, dsl.ATTRIBUTE.name(task.attribute)
  episode = ws.Episode(task)
  _submit(episode, "main", f"search {a} {dsl.ENTITY.name(gold[0][0])} |")
  _submit(episode, "main", f"create follower S1 S2 assign {a} S1 S2 all |")
  (request,) = episode.requests()                                   # one next entity: S2's share is empty
  assert dsl.decode(request.context) == f"sub follower {a} {dsl.ENTITY.name(gold[1][0])} |"
  while not episode.done:
    for request in episode.requests():
      episode.submit(request.agent, ws.solo_policy(request.context))
  result = episode.result()
  assert result.score.success and result.num_finished == 1 and result.num_idle == 1


def test_scripted_policies_solve_every_wide_split_when_the_budget_allows():
  for n in range(2, 9):
    task = ws.make_task(100 + n, kind="wide", n=n)
    for k in range(n + 1):
      needed = n + 1 if k == 0 else math.ceil(n / k) + 2
      result = ws.run_episode(task, ws.ScriptedOrchestrator(k), budget=needed)
      assert result.score.success and result.errors == {"orch": {}, "sub": {}}
      assert result.num_finished == result.num_assigned == min(k, n)


def test_lost_hand_backs_leave_their_rows_unobserved_and_their_sub_tasks_unfinished():
  task = ws.make_task(105, kind="wide", n=6)
  # every hand-back lost: the orchestrator observes no row of its two sub-agents, answers with nothing
  lost = ws.run_episode(task, ws.ScriptedOrchestrator(2), budget=5, subagent_failure=1.0, rng=np.random.default_rng(0))
  assert (lost.num_lost, lost.num_finished, lost.num_assigned) == (2, 0, 2)
  assert lost.score.item_recall == 0.0 and lost.metrics()["num_lost"] == 2.0
  # none lost (p = 0, no rng needed): the same episode as without the option
  kept = ws.run_episode(task, ws.ScriptedOrchestrator(2), budget=5, subagent_failure=0.0)
  assert kept.num_lost == 0 and kept.score.success and kept.num_finished == 2
  # p = 0.5 over many episodes: about half the hand-backs lost, drawn from the episode's rng
  rng = np.random.default_rng(1)
  results = [ws.run_episode(task, ws.ScriptedOrchestrator(2), budget=5, subagent_failure=0.5, rng=rng)
             for _ in range(200)]
  share = sum(r.num_lost for r in results) / sum(r.num_assigned for r in results)
  assert 0.4 < share < 0.6
  with pytest.raises(ValueError, match="rng"):
    ws.Episode(task, subagent_failure=0.5)
  with pytest.raises(ValueError, match="subagent_step_cost"):
    ws.Episode(task, subagent_step_cost=0)


def test_costlier_sub_agent_steps_take_that_many_critical_steps():
  n, k = 6, 2
  task = ws.make_task(106, kind="wide", n=n)
  # each of the 2 sub-agents needs 3 lookups: at cost 2 they take 6 critical steps, 1 + 6 + 1 in all
  result = ws.run_episode(task, ws.ScriptedOrchestrator(k), budget=8, subagent_step_cost=2)
  assert result.score.success and result.critical_steps == 1 + 2 * math.ceil(n / k) + 1
  # a budget one short: (7 − 0 − 2) // 2 = 2 steps each (2 of 3 lookups per sub-agent, a stage of
  # 1 + 4 critical steps), then the orchestrator's own lookup in the step before its answer: 5 of 6
  short = ws.run_episode(task, ws.ScriptedOrchestrator(k), budget=7, subagent_step_cost=2)
  assert short.trace.stages[0] == {0: 4, 1: 4} and short.critical_steps == 7
  assert short.score.item_recall == pytest.approx(5 / 6)


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


def test_contexts_fit_the_tiny_length_at_the_widest_task_and_largest_budget():
  longest = 0
  for seed in range(3):
    task = ws.make_task(seed, kind="wide", n=24, budget=dsl.MAX_BUDGET)
    for k in range(9):
      result = ws.run_episode(task, ws.ScriptedOrchestrator(k))
      longest = max([longest, len(result.orchestrator.tokens)] + [len(t.tokens) for t in result.subagents])
  for hops in (3, 5, 8):
    for k in (0, 1):
      result = ws.run_episode(ws.make_task(hops, kind="deep", hops=hops, budget=dsl.MAX_BUDGET),
                              ws.ScriptedOrchestrator(k))
      longest = max([longest, len(result.orchestrator.tokens)] + [len(t.tokens) for t in result.subagents])
  assert 145 <= longest <= ws.MAX_CONTEXT == 160


def test_demonstrations_are_deterministic_and_varied():
  a, b = ws.demonstrations(40, seed=1), ws.demonstrations(40, seed=1)
  assert a.keys() == b.keys() and all(np.array_equal(a[key], b[key]) for key in a)
  assert not np.array_equal(a["tokens"], ws.demonstrations(40, seed=2)["tokens"])
  prefix = ws.demonstrations(10, seed=1)
  assert np.array_equal(prefix["tokens"], a["tokens"][:len(prefix["tokens"])])
  assert a["tokens"].shape[1] == ws.MAX_CONTEXT and set(a["role"].tolist()) == {0, 1}
  orchestrators = np.bincount(a["role"])[0]          # one per episode, plus the capability rows
  assert 40 < orchestrators <= 80 and a["episode"].max() == 39
  assert np.bincount(ws.demonstrations(40, seed=1, capability_share=0.0)["role"])[0] == 40
  assert 0.0 < a["item_f1"].min() < 1.0 == a["item_f1"].max()        # truncated and solved episodes
  assert a["critical_steps"].max() <= ws.DEMO_BUDGETS[1]


def test_demonstrated_orchestrator_starts_in_serial_collapse_with_competent_subagents():
  demos = ws.demonstrations(400, seed=0)
  wide = demos["kind"] == 0
  assert demos["num_subagents"][wide].mean() <= 0.5                 # create/assign: shown, rarely
  assert 0 < (demos["num_subagents"] > 0).mean() <= 0.2 and demos["num_subagents"][~wide].max() <= 1
  subs = demos["role"] == 1                                          # sub-agent rows cover big assignments
  assert (demos["length"][subs] > 40).any() and subs.sum() >= 1.5 * 400
  orch = np.flatnonzero(demos["role"] == 0)                         # capability rows: a split, its first
  first_turn = [r for r in orch if demos["tokens"][r, demos["tokens"][r].tolist().index(dsl.EOT_ID) + 1] == dsl.CREATE_ID]
  unchosen = [r for r in first_turn if demos["loss_mask"][r, demos["tokens"][r].tolist().index(dsl.EOT_ID) + 1] == 0]
  assert len(unchosen) >= 150 and len(first_turn) - len(unchosen) == (demos["num_subagents"] > 0).sum()
  assert demos["item_f1"][(demos["num_subagents"] == 0) & wide].mean() < demos["item_f1"][demos["num_subagents"] > 0].mean()


def _segments(mask_row):
  """(start, end) of each run of 1s."""
  padded = np.concatenate([[0], mask_row, [0]])
  edges = np.flatnonzero(np.diff(padded))
  return list(zip(edges[0::2], edges[1::2]))


def test_demonstration_loss_masks_cover_exactly_the_policy_turns():
  demos = ws.demonstrations(24, seed=3, delegation_share=0.5)
  for row in range(len(demos["role"])):
    tokens, mask, length = demos["tokens"][row], demos["loss_mask"][row], demos["length"][row]
    assert tokens[0] == (dsl.SUB_ID if demos["role"][row] else dsl.ORCH_ID)
    assert not mask[length:].any() and not (tokens[length:] != dsl.PAD_ID).any()
    segments = _segments(mask)
    assert segments and segments[-1][1] == length            # a context ends with the agent's answer turn
    for start, end in segments:
      turn = tokens[start:end].tolist()
      assert turn[-1] == dsl.EOT_ID and turn.count(dsl.EOT_ID) == 1
      assert turn[0] in dsl.TOOL_IDS or tokens[start - 1] == dsl.CREATE_ID
      delegates = demos["role"][row] == 0 and tokens[start] == dsl.CREATE_ID
      capability = demos["role"][row] == 0 and tokens[start - 1] == dsl.CREATE_ID  # the choice carries no loss
      if capability:
        start -= 1
        turn = tokens[start:end].tolist()
      if not (delegates or capability):                       # every other turn is the solo agent's
        assert turn == ws.solo_policy(tokens[:start].tolist())
      else:                                                   # a split opens the episode
        assert start == tokens.tolist().index(dsl.EOT_ID) + 1
        k = sum(isinstance(c, tools.CreateSubagent) for c in tools.parse_turn(turn, role="orch").calls)
        assert turn == tools.render_turn(ws.delegation(tools.read_context(tokens[:start].tolist()), k))
      assert tools.parse_turn(turn, role="orch").errors == ()
    unmasked = tokens[:length][mask[:length] == 0].tolist()
    unmasked = [t for i, t in enumerate(unmasked) if not (i and t == dsl.CREATE_ID and unmasked[i - 1] == dsl.EOT_ID)]
    assert not any(t in dsl.TOOL_IDS for t in unmasked)     # prompt and observations only (no errors here)
    blocks = dsl.decode(unmasked).split(" | ")
    assert all(block.split()[0] == "obs" for block in blocks[1:] if block)


def test_demonstrations_reject_contexts_over_the_limit():
  with pytest.raises(ValueError, match="max_length"):
    ws.demonstrations(8, seed=0, max_length=20)
