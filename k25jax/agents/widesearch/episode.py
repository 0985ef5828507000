"""The budgeted episode (`Episode`): agent transcripts, turn requests, and the result.

Steps (stages and CriticalSteps: `k25jax.agents.widesearch.steps`). A sub-agent's closing
`answer` turn is its hand-back, delivered with the orchestrator's next observation, and is
not a step; the orchestrator's answer turn is a stage of its own (1 step). So:

    wide task of n entities split over k sub-agents:  1 + ceil(n / k) + 1
    the orchestrator alone (k = 0):                   n + 1   (deep chain of h rows: h + 1)

The budget (the task's, shown in the orchestrator's prompt) truncates, it never zeroes:
the last step is kept for the orchestrator's answer, sub-agents started in a stage may
take `budget − used − 2` steps (an assignment with none left fails with `err assign`, code `budget`), a sub-agent at its
limit sees `stop` and must answer with what it has, and once only the answer step is
left the orchestrator's observation ends with `stop`. A forced turn that does not answer
ends that agent with an empty answer (code `no_answer`). The partial table is scored.
With budget B: the orchestrator alone answers B − 1 lookups, each sub-agent started in the
first stage B − 2.

Weaker or costlier sub-agents (the setting of the λ ablation, where the paper's sub-agents
are frozen at an intermediate checkpoint): with `subagent_failure` = p each finished
sub-agent's hand-back is lost with probability p (drawn from the episode's `rng`; the
orchestrator observes none of its rows, and the sub-task counts as not finished), and with
`subagent_step_cost` = c each sub-agent step takes c critical steps (S_sub,i^t = c × its
tool turns; a sub-agent started with s steps left may take (s − 2) // c).

Driving an episode (the swarm runtime batches `requests()` of many episodes):

    episode = Episode(task)                       # or Episode(task, budget=B): the task under budget B;
                                                  # Episode(task, rendering=ChatRendering()): in the chat format
    while not episode.done:
      for request in episode.requests():          # the orchestrator, or this stage's sub-agents
        episode.submit(request.agent, policy(request.context))
    result = episode.result()                     # scores, step trace, transcripts + loss masks
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

from k25jax.agents import dsl
from k25jax.agents import tools
from k25jax.agents.widesearch.rendering import DSLRendering, Rendering
from k25jax.agents.widesearch.scoring import TableScore, score_table, table_rows
from k25jax.agents.widesearch.steps import StepTrace
from k25jax.agents.widesearch.tasks import TERMINAL_VALUE, Task, remaining


@dataclasses.dataclass
class AgentTranscript:
  """One agent context as it grew, in the episode's rendering: `tokens` what the model reads,
  `loss_mask` 1 on tokens the agent generated (its turns), 0 on the environment's (prompt,
  observations, what closes a truncated turn); `logprobs` as submitted for generated
  tokens, 0 elsewhere. `protocol` is the same context in DSL ids, the text form the
  environment reads (`rendering`); under the DSL rendering it equals `tokens`."""

  role: str
  agent: str
  stage: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  protocol: list[int] = dataclasses.field(default_factory=list)
  last_turn: list[int] = dataclasses.field(default_factory=list)   # the generated ids of its latest turn

  def add(self, tokens: Sequence[int], *, generated: bool, logprobs: Sequence[float] | None = None,
          protocol: Sequence[int] | None = None) -> None:
    """Appends rendered `tokens`, and their DSL ids `protocol` (default: `tokens`, the DSL rendering)."""
    tokens = [int(t) for t in tokens]
    if logprobs is None:
      logprobs = [0.0] * len(tokens)
    if len(logprobs) != len(tokens):
      raise ValueError(f"{len(logprobs)} logprobs for {len(tokens)} tokens")
    self.tokens += tokens
    self.loss_mask += [int(generated)] * len(tokens)
    self.logprobs += [float(x) for x in logprobs]
    self.protocol += tokens if protocol is None else [int(t) for t in protocol]

  @property
  def text(self) -> str:
    """The context's readable text (DSL words)."""
    return dsl.decode(self.protocol)


@dataclasses.dataclass(frozen=True)
class Request:
  """An agent waiting for its next turn: `agent` "main" or a sub-agent name ("S1"),
  `role` orch|sub, `context` its token ids so far in the episode's rendering (generate the
  turn after them), `protocol` the same in DSL ids (what scripted policies read)."""

  agent: str
  role: str
  context: tuple[int, ...]
  protocol: tuple[int, ...]


@dataclasses.dataclass
class _SubagentRun:
  """One assignment being worked on by a sub-agent in the current stage."""

  task: tools.AssignTask
  system_prompt: str
  transcript: AgentTranscript
  allowance: int
  steps: int = 0
  forced: bool = False
  rows: tuple[tuple[int, int], ...] | None = None
  done: bool = False

  @property
  def finished(self) -> bool:
    """The sub-task was completed: a searcher answered every entity it was given, a
    follower answered a chain that reached the terminal value."""
    if self.rows is None:
      return False
    if self.system_prompt == "follower":
      return bool(self.rows) and self.rows[-1][1] == TERMINAL_VALUE
    answered = {e for e, _ in self.rows}
    return all(e in answered for e in self.task.entities)


@dataclasses.dataclass
class EpisodeResult:
  """A finished episode. `prediction` is the orchestrator's answer rows (empty if it gave
  none); counts feed r_parallel (num_created) and r_finish (num_finished over the
  sub-tasks: num_assigned assignments plus num_idle agents created and never assigned);
  `errors` counts ToolError codes per role."""

  task: Task
  prediction: tuple[tuple[int, int], ...]
  score: TableScore
  trace: StepTrace
  forced: bool
  num_created: int
  num_assigned: int
  num_finished: int
  num_idle: int
  errors: dict[str, collections.Counter]
  orchestrator: AgentTranscript
  subagents: list[AgentTranscript]
  num_lost: int = 0     # hand-backs lost (`subagent_failure`)

  @property
  def critical_steps(self) -> int:
    return self.trace.critical_steps

  def metrics(self) -> dict[str, float]:
    """Flat floats for the logs."""
    out = {f"item_{m}": getattr(self.score, f"item_{m}") for m in ("precision", "recall", "f1")}
    out.update(row_f1=self.score.row_f1, success=float(self.score.success),
               critical_steps=float(self.critical_steps), forced=float(self.forced),
               num_created=float(self.num_created), num_assigned=float(self.num_assigned),
               num_finished=float(self.num_finished), num_idle=float(self.num_idle), num_lost=float(self.num_lost),
               errors_orch=float(sum(self.errors["orch"].values())),
               errors_sub=float(sum(self.errors["sub"].values())))
    return out


def _answer_rows(answer: tools.Answer | None, view: tools.ContextView) -> tuple[tuple[int, int], ...]:
  """The rows an answer gives: its own, or (`answer all`) every cell its agent observed."""
  if answer is None:
    return ()
  return view.found if answer.found else answer.rows


class Episode:
  """One budgeted episode: the orchestrator, the sub-agents it creates, the hidden table.

  Agents take turns through `requests()` / `submit()`; the environment parses each turn,
  runs its calls, accounts the steps and writes the observations (module docstring).
  Every sub-agent assignment is a fresh context `sub SYSTEM A E.. |` (the system prompt
  its name was created with); the orchestrator observes the rows each sub-agent answered,
  in assignment order, then its own search result, then its errors. An `assign .. all`
  splits the lookups the orchestrator's observations so far leave (`remaining`), a
  `search .. next` makes the first lookup its agent's leave, an `answer all` answers the
  cells its agent has observed.
  """

  def __init__(self, task: Task, *, budget: int | None = None, max_subagent_steps: int | None = None,
               rendering: Rendering | None = None, subagent_failure: float = 0.0, subagent_step_cost: int = 1,
               rng: np.random.Generator | None = None):
    budget = task.budget if budget is None else int(budget)
    if budget < 2:
      raise ValueError(f"budget={budget}: an episode needs at least 2 critical steps (a step and the answer)")
    if max_subagent_steps is not None and max_subagent_steps < 1:
      raise ValueError(f"max_subagent_steps={max_subagent_steps} must be >= 1")
    if not 0.0 <= subagent_failure <= 1.0 or subagent_step_cost < 1:
      raise ValueError(f"subagent_failure={subagent_failure} must lie in [0, 1] and subagent_step_cost="
                       f"{subagent_step_cost} be >= 1")
    if subagent_failure > 0 and rng is None:
      raise ValueError("subagent_failure > 0 draws from the episode's rng: pass one")
    self.task = task if budget == task.budget else task.with_budget(budget)
    self.max_subagent_steps = max_subagent_steps
    self.subagent_failure, self.subagent_step_cost, self.rng = subagent_failure, int(subagent_step_cost), rng
    self.num_lost = 0
    self.rendering = DSLRendering() if rendering is None else rendering
    self.trace = StepTrace()
    self.orchestrator = AgentTranscript("orch", "main", 0)
    self.orchestrator.add(self.rendering.prompt(self.task.prompt()), generated=False, protocol=self.task.prompt())
    self.subagents: list[AgentTranscript] = []
    self.created: dict[int, str] = {}
    self.errors = {"orch": collections.Counter(), "sub": collections.Counter()}
    self.num_assigned = 0
    self.num_finished = 0
    self._ever_assigned: set[int] = set()
    self.forced = False
    self.done = False
    self.prediction: tuple[tuple[int, int], ...] = ()
    self._runs: dict[int, _SubagentRun] = {}
    self._main_rows: list[tuple[int, int]] = []
    self._main_errors: list[tools.ToolError] = []
    self._main_waiting = True

  @property
  def budget(self) -> int:
    """The critical-step budget this episode runs under (its task's, as the prompt shows)."""
    return self.task.budget

  @property
  def used_steps(self) -> int:
    return self.trace.critical_steps

  def requests(self) -> list[Request]:
    """Agents waiting for a turn: the orchestrator alone, or the unfinished sub-agents of this stage."""
    if self.done:
      return []
    if self._main_waiting:
      return [Request("main", "orch", tuple(self.orchestrator.tokens), tuple(self.orchestrator.protocol))]
    return [Request(dsl.AGENT.name(slot), "sub", tuple(run.transcript.tokens), tuple(run.transcript.protocol))
            for slot, run in self._runs.items() if not run.done]

  def submit(self, agent: str, tokens: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
    """Gives `agent` ("main" or "S1".."S8") its generated turn: the generated ids in the
    episode's rendering (read up to the turn's stop, or all of them if it never came), with
    their log-probs if any."""
    if self.done:
      raise ValueError("the episode is over")
    if agent == "main":
      if not self._main_waiting:
        raise ValueError("the orchestrator is waiting for its sub-agents")
      self._orchestrator_turn(tokens, logprobs)
      return
    slot = dsl.AGENT.index(dsl.token_id(agent)) if agent in dsl.AGENT.names else None
    if slot is None or slot not in self._runs or self._runs[slot].done:
      raise ValueError(f"agent {agent!r} has no pending turn")
    self._subagent_turn(self._runs[slot], tokens, logprobs)

  # -- turns --

  def _turn(self, transcript: AgentTranscript, generated, logprobs, role: str, **known) -> tools.ParsedTurn:
    """Reads a generated turn through the rendering, parses its DSL words and records it."""
    tokens, words = self.rendering.read_turn(generated)
    parsed = tools.parse_turn(words, role=role, **known)
    turn_logprobs = None if logprobs is None else list(logprobs)[:len(tokens)]
    transcript.add(tokens, generated=True, logprobs=turn_logprobs, protocol=parsed.tokens)
    transcript.last_turn = list(tokens)
    if not parsed.complete:
      transcript.add(self.rendering.close(), generated=False, protocol=[dsl.EOT_ID])
    self.errors[role].update(e.code for e in parsed.errors)
    return parsed

  def _observe(self, transcript: AgentTranscript, block: list[int]) -> None:
    transcript.add(self.rendering.observation(block, transcript.last_turn), generated=False, protocol=block)

  def _error(self, role: str, code: str, tool: str | None, detail: str) -> tools.ToolError:
    self.errors[role][code] += 1
    return tools.ToolError(code, tool, detail)

  def _orchestrator_turn(self, tokens, logprobs) -> None:
    view = tools.read_context(self.orchestrator.protocol)
    parsed = self._turn(self.orchestrator, tokens, logprobs, "orch", known_agents=self.created)
    self._main_waiting = False
    if parsed.answer is not None or self.forced:
      if parsed.answer is None:
        self._error("orch", "no_answer", None, "the budget forced an answer")
      self.trace.add_stage()
      self.prediction = _answer_rows(parsed.answer, view)
      self.done = True
      return
    self._main_rows, self._main_errors = [], list(parsed.errors)
    needed = remaining(view)
    for call in parsed.valid:
      if isinstance(call, tools.CreateSubagent):
        self.created[call.agent] = call.system_prompt
      elif isinstance(call, tools.AssignShare):
        share = tuple(int(e) for e in np.array_split(np.asarray(needed, np.int64), call.shares)[call.share])
        if share:
          self._start_subagent(tools.AssignTask(call.agent, call.attribute, share))
        else:
          self._main_errors.append(self._error("orch", "nothing_left", "assign",
                                               f"{dsl.AGENT.name(call.agent)}'s share of the remaining lookups is empty"))
      elif isinstance(call, tools.AssignTask):
        self._start_subagent(call)
      elif isinstance(call, (tools.Search, tools.SearchNext)):
        self._main_rows += self._lookup(call, needed, "orch", self._main_errors)
    if not self._runs:
      self._close_stage()

  def _lookup(self, call, needed: tuple[int, ...], role: str, errors: list) -> list[tuple[int, int]]:
    """A search's found cell [(entity, value)]: its entity's, or (`search .. next`) the first
    of the lookups its agent still needs; none (and a `nothing_left` error) if none is left."""
    if isinstance(call, tools.Search):
      return [(call.entity, self.task.lookup(call.entity, call.attribute))]
    if not needed:
      errors.append(self._error(role, "nothing_left", "search", "no lookup is left to search next"))
      return []
    return [(needed[0], self.task.lookup(needed[0], call.attribute))]

  def _start_subagent(self, call: tools.AssignTask) -> None:
    allowance = (self.budget - self.used_steps - 2) // self.subagent_step_cost
    if self.max_subagent_steps is not None:
      allowance = min(allowance, self.max_subagent_steps)
    if allowance < 1:
      self._main_errors.append(self._error("orch", "budget", "assign", "no sub-agent step left"))
      return
    name, system = dsl.AGENT.name(call.agent), self.created[call.agent]
    transcript = AgentTranscript("sub", name, len(self.trace.stages))
    prompt = tools.format_prompt("sub", system, call.attribute, call.entities)
    transcript.add(self.rendering.prompt(prompt), generated=False, protocol=prompt)
    self._runs[call.agent] = _SubagentRun(call, system, transcript, allowance)
    self.subagents.append(transcript)
    self.num_assigned += 1
    self._ever_assigned.add(call.agent)

  def _subagent_turn(self, run: _SubagentRun, tokens, logprobs) -> None:
    view = tools.read_context(run.transcript.protocol)
    parsed = self._turn(run.transcript, tokens, logprobs, "sub")
    if parsed.answer is not None or run.forced:
      if parsed.answer is None:
        self._error("sub", "no_answer", None, "the budget forced an answer")
      run.rows = _answer_rows(parsed.answer, view) if parsed.answer is not None else None
      run.done = True
    else:
      run.steps += 1
      errors, needed = list(parsed.errors), remaining(view)
      rows = [row for c in parsed.valid if isinstance(c, (tools.Search, tools.SearchNext))
              for row in self._lookup(c, needed, "sub", errors)]
      run.forced = run.steps >= run.allowance
      self._observe(run.transcript, tools.format_observation(rows, errors, stop=run.forced))
    if all(r.done for r in self._runs.values()):
      self._close_stage()

  def _close_stage(self) -> None:
    """Records the stage's steps, loses hand-backs (`subagent_failure`) and writes the
    orchestrator's observation."""
    self.trace.add_stage({slot: run.steps * self.subagent_step_cost for slot, run in self._runs.items()})
    for run in self._runs.values():
      if run.rows is not None and self.subagent_failure and self.rng.random() < self.subagent_failure:
        run.rows = None
        self.num_lost += 1
    rows = [row for run in self._runs.values() if run.rows for row in run.rows] + self._main_rows
    self.num_finished += sum(run.finished for run in self._runs.values())
    self._runs = {}
    self.forced = self.used_steps + 1 >= self.budget
    self._observe(self.orchestrator, tools.format_observation(rows, self._main_errors, stop=self.forced))
    self._main_waiting = True

  def result(self) -> EpisodeResult:
    if not self.done:
      raise ValueError("the episode is still running")
    column = self.task.attribute
    score = score_table(table_rows(self.prediction, column), table_rows(self.task.gold, column))
    return EpisodeResult(self.task, self.prediction, score, self.trace, self.forced, len(self.created),
                         self.num_assigned, self.num_finished, len(set(self.created) - self._ever_assigned),
                         self.errors, self.orchestrator, list(self.subagents), self.num_lost)
