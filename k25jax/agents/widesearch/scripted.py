"""Scripted reference policies (`solo_policy`, `ScriptedOrchestrator`, `SerialOrchestrator`),
`run_episode` to drive an episode with plain callables, and the SFT `demonstrations` they write.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import numpy as np

from k25jax.agents import dsl
from k25jax.agents import tools
from k25jax.agents.widesearch.episode import AgentTranscript, Episode, EpisodeResult
from k25jax.agents.widesearch.rendering import DSLRendering, Rendering
from k25jax.agents.widesearch.tasks import MAX_CONTEXT, Task, remaining, sample_tasks

Policy = Callable[[Sequence[int]], list[int]]


def _solo_call(view: tools.ContextView) -> tools.ToolCall:
  """`search A next` while a lookup is needed (`remaining`), then (or when stopped) `answer all`."""
  if remaining(view) and not view.stopped:
    return tools.SearchNext(view.attribute)
  return tools.Answer((), found=True)


def solo_policy(context: Sequence[int]) -> list[int]:
  """Scripted single agent (a sub-agent, or an orchestrator without sub-agents): one search
  per step over its entities (searcher) or along the chain (follower), then `answer all`."""
  return tools.render_turn([_solo_call(tools.read_context(context))])


def delegation(view: tools.ContextView, num_subagents: int) -> list[tools.ToolCall]:
  """The calls that split what a task still needs over new sub-agents S1..Sk,
  `create searcher S1 .. Sk assign A S1 .. Sk all` (k capped at the lookups left); a deep
  chain goes to one follower, `create follower S1 assign A S1 all`."""
  system, k = ("follower", 1) if view.chain else ("searcher", min(num_subagents, len(remaining(view))))
  return ([tools.CreateSubagent(slot, system) for slot in range(k)]
          + [tools.AssignShare(slot, view.attribute, slot, k) for slot in range(k)])


@dataclasses.dataclass(frozen=True)
class ScriptedOrchestrator:
  """Scripted orchestrator: with num_subagents = k > 0 its first turn delegates (see
  `delegation`); afterwards (and always when k = 0) it acts as `solo_policy` over what it
  has observed: it searches what is still missing, and answers when done or stopped."""

  num_subagents: int

  def __call__(self, context: Sequence[int]) -> list[int]:
    view = tools.read_context(context)
    if view.num_turns == 0 and self.num_subagents > 0:
      return tools.render_turn(delegation(view, self.num_subagents))
    return tools.render_turn([_solo_call(view)])


@dataclasses.dataclass
class SerialOrchestrator:
  """The warm start's orchestrator: it solves the task alone (`solo_policy`), except that with
  probability `delegation_share` its first turn delegates with a random split (`delegation`
  over k sub-agents, k uniform in 1..min(n, 8), whatever the task's width or budget; a
  chain goes to one follower) and then it carries on alone over what is still missing.
  So create/assign are shown and their hand-backs read, but splitting is not preferred,
  and the split shown is never chosen for the task. `rng` draws both choices."""

  rng: np.random.Generator
  delegation_share: float = 0.1

  def __call__(self, context: Sequence[int]) -> list[int]:
    view = tools.read_context(context)
    if view.num_turns == 0 and self.rng.random() < self.delegation_share:
      k = int(self.rng.integers(1, min(len(view.entities), dsl.NUM_AGENTS) + 1))
      return tools.render_turn(delegation(view, k))
    return tools.render_turn([_solo_call(view)])


def run_episode(task: Task, orchestrator: Policy, subagent: Policy = solo_policy, **episode_options) -> EpisodeResult:
  """Drives one episode with plain callables (DSL context ids → DSL turn ids) until it ends;
  `episode_options` are `Episode`'s (budget: the task's unless given; rendering: the DSL's
  unless given, each turn rendered as the model would write it; the sub-agents' failure and
  step cost)."""
  episode = Episode(task, **episode_options)
  while not episode.done:
    for request in episode.requests():
      policy = orchestrator if request.role == "orch" else subagent
      episode.submit(request.agent, episode.rendering.turn(policy(request.protocol)))
  return episode.result()


DEMO_BUDGETS = (dsl.MIN_BUDGET + 1, dsl.MAX_BUDGET)   # demonstrations span every budget a prompt shows but 2


def _without_first_choice(transcript: AgentTranscript, rendering: Rendering) -> AgentTranscript:
  """A copy with the loss off the agent's first decision (`create` in the DSL, its `c` after
  `<|call|>` in k25jax's chat, `create_subagent`'s `c` in K2.5's: `Rendering.choice_offset`)."""
  mask = list(transcript.loss_mask)
  first = mask.index(1)
  mask[first + rendering.choice_offset(transcript.tokens[first:])] = 0
  return dataclasses.replace(transcript, loss_mask=mask)


def demonstrations(num_episodes: int, seed: int, *, deep_fraction: float = 0.25, delegation_share: float = 0.1,
                   subagent_rows: int = 2, capability_share: float = 0.5,
                   budget_range: tuple[int, int] = DEMO_BUDGETS,
                   max_length: int = MAX_CONTEXT, rendering: Rendering | None = None,
                   **task_kwargs) -> dict[str, np.ndarray]:
  """SFT demonstrations of both roles, from scripted policies run through the budgeted env.

  The orchestrator starts in serial collapse: its demonstrations solve each task alone
  (`SerialOrchestrator`: one lookup per step, the answer when done or stopped), except a
  `delegation_share` of them that open with a random split. The sub-agents must be
  competent (they are frozen in PARL): their demonstrations come from a second run of the
  same task by `ScriptedOrchestrator(k)`, k uniform in 1..min(n, 8) (a deep task: 1
  follower), whose orchestrator context is dropped and up to `subagent_rows` of whose
  sub-agent contexts are kept (drawn at random), so they cover assignments of every size,
  truncated ones included (the orchestrator's own delegations add theirs). In a
  `capability_share` of episodes that run's orchestrator context is kept too, with the
  loss off its first token (`create`, the choice to split): the model learns to write a
  split and to read its hand-backs without learning to prefer splitting, which only the
  `delegation_share` teaches. Tasks draw budgets from `budget_range` (inclusive). The
  contexts are in `rendering` (default the DSL's; `max_length` counts its ids). Every
  context is one row (deterministic given seed):
    tokens     int32 [N, max_length]   context, then PAD
    loss_mask  float32 [N, max_length] 1 on generated tokens (the SFT targets:
               weights = loss_mask[:, 1:] for targets tokens[:, 1:])
    length     int32 [N]   role  int32 [N] (0 orchestrator, 1 sub-agent)   episode  int32 [N]
  and per episode, of the orchestrator's demonstration: num_subagents, item_f1,
  critical_steps, width, kind (0 wide, 1 deep) [num_episodes]. The first m episodes of a
  run are the m episodes of a shorter run with the same seed.
  Raises ValueError if a context is longer than max_length.
  """
  tasks = sample_tasks(num_episodes, seed, deep_fraction=deep_fraction, budget_range=budget_range, **task_kwargs)
  rendering = DSLRendering() if rendering is None else rendering
  rows, per_episode = [], collections.defaultdict(list)
  for index, task in enumerate(tasks):
    rng = np.random.default_rng((seed, index, 1))
    result = run_episode(task, SerialOrchestrator(rng, delegation_share), rendering=rendering)
    k = 1 if task.kind == "deep" else int(rng.integers(1, min(len(task.entities), dsl.NUM_AGENTS) + 1))
    split = run_episode(task, ScriptedOrchestrator(k), rendering=rendering)
    helpers = [split.subagents[i] for i in sorted(rng.permutation(len(split.subagents))[:subagent_rows])]
    if rng.random() < capability_share:
      helpers.append(_without_first_choice(split.orchestrator, rendering))
    rows += [(t, index) for t in [result.orchestrator, *result.subagents, *helpers]]
    per_episode["num_subagents"].append(result.num_created)
    per_episode["item_f1"].append(result.score.item_f1)
    per_episode["critical_steps"].append(result.critical_steps)
    per_episode["width"].append(task.width)
    per_episode["kind"].append(int(task.kind == "deep"))
  longest = max(len(t.tokens) for t, _ in rows)
  if longest > max_length:
    raise ValueError(f"a demonstration context has {longest} tokens, more than max_length={max_length}")
  tokens = np.full((len(rows), max_length), rendering.pad_id, np.int32)
  loss_mask = np.zeros((len(rows), max_length), np.float32)
  for j, (transcript, _) in enumerate(rows):
    tokens[j, :len(transcript.tokens)] = transcript.tokens
    loss_mask[j, :len(transcript.tokens)] = transcript.loss_mask
  return {"tokens": tokens, "loss_mask": loss_mask,
          "length": np.array([len(t.tokens) for t, _ in rows], np.int32),
          "role": np.array([int(t.role == "sub") for t, _ in rows], np.int32),
          "episode": np.array([i for _, i in rows], np.int32),
          **{name: np.array(values, np.float32 if name == "item_f1" else np.int32)
             for name, values in per_episode.items()}}
