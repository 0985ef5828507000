"""k25jax.agents.trace: an episode rendered stage by stage, every block of every agent once."""
import re

from k25jax.agents import dsl, trace
from k25jax.agents import widesearch as ws


def _agent_lines(text: str) -> dict[str, list[str]]:
  """agent name → the blocks rendered for it, in order (lines `<indent><agent>  <'>' or '<'> <block>`)."""
  out = {}
  for line in text.splitlines():
    match = re.fullmatch(r" +(main|S\d) +([<>]) (.*)", line)
    if match:
      out.setdefault(match.group(1), []).append((match.group(2), match.group(3)))
  return out


def test_every_block_of_every_agent_appears_once_in_order():
  result = ws.run_episode(ws.make_task(7, kind="wide", n=5), ws.ScriptedOrchestrator(2), budget=4)
  rendered = _agent_lines(trace.render(result))
  main = rendered["main"]
  # the orchestrator's prompt is the task header, not a line: the rest of its context, in order
  assert " ".join(text for _, text in main) == dsl.decode(
      result.orchestrator.tokens[len(result.task.prompt()):])
  for transcript in result.subagents:
    assert " ".join(text for _, text in rendered[transcript.agent]) == transcript.text
    assert [mark for mark, _ in rendered[transcript.agent]] == ["<", ">", "<", ">", "<", ">"]
  assert set(rendered) == {"main", "S1", "S2"}


def test_stage_headers_add_up_to_the_critical_steps():
  for k, budget in ((0, 6), (3, 4), (8, 4)):
    result = ws.run_episode(ws.make_task(5, kind="wide", n=6), ws.ScriptedOrchestrator(k), budget=budget)
    text = trace.render(result)
    costs = [int(m.group(2) or m.group(1)) for m in
             re.finditer(r"^stage \d+  \((?:(1) critical step|.*= (\d+) critical steps)\)$", text, re.M)]
    assert len(costs) == len(result.trace.stages)
    assert sum(costs) == result.critical_steps
    assert text.splitlines()[-1].startswith(f"Item-F1 {result.score.item_f1:.2f}")


def test_sub_agents_are_listed_under_the_stage_that_assigned_them():
  result = ws.run_episode(ws.make_task(11, kind="deep", hops=3), ws.ScriptedOrchestrator(1), budget=10)
  stages = trace.render(result).split("\nstage ")[1:]
  assert "create follower S1 assign" in stages[0] and "S1    > search" in stages[0]
  assert len(stages) == 2 and "S1    " not in stages[1] and "main  > answer" in stages[1]
  assert stages[0].startswith("1  (1 + 3 = 4 critical steps)")


def test_a_truncated_turn_is_one_generated_block_and_errors_are_reported():
  task = ws.make_task(2, kind="wide", n=2)
  episode = ws.Episode(task, budget=4)
  episode.submit("main", dsl.encode("search A1"))               # no `|`: truncated, the env closes it
  answer = dsl.encode("answer |")
  episode.submit("main", answer)
  result = episode.result()
  parts = trace.blocks(result.orchestrator)
  assert [b.generated for b in parts] == [False, True, False, True]
  assert parts[1].text == "search A1 |" and parts[3].tokens == tuple(answer)
  text = trace.render(result)
  assert "tool errors {'orch': {'truncated': 1}}" in text and "answer: (none)" in text
