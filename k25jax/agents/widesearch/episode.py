"""The synthetic wide-search environment of tiny PARL: hidden tables, tasks, scoring, the
budgeted episode, and scripted reference policies that write SFT demonstrations.

Hidden table. Each episode draws a table of 32 entities × 4 attributes with values
V0..V15 (deterministic given the seed). `search A E` reveals one cell; an agent makes at
most one search per step.

Tasks (`make_task`, `sample_tasks`):
* wide  "give attribute A for entities E_1..E_n" (n in 2..8): prompt `orch searcher A E1 .. En |`;
  the gold table has one row per entity. Lookups are independent: n sub-agents can
  do them in one step.
* deep  "follow attribute A from entity E": prompt `orch follower A E |`. A value links to
  the entity of the same number (Vk names Ek) and V0 ends the chain (`next_entity`). The
  gold table is the chain of visited rows E→V, 2..3 hops. Each lookup needs the previous
  value, so parallelism cannot help; delegating costs one extra step (the orchestrator
  should learn NOT to spawn here).

Scoring (`score_table`, WideSearch metrics): Item-F1 over cells matched on the key
column (entity), Row-F1 over whole rows, success = exact table.

Steps and budget (`StepTrace`, `Episode`). An episode is a sequence of stages; stage t is
one orchestrator turn (S_main^t = 1) plus the sub-agents it assigned, which run in
parallel; S_sub,i^t counts sub-agent i's tool turns in the stage. A sub-agent's closing
`answer` turn is its hand-back, delivered with the orchestrator's next observation, and is
not a step; the orchestrator's answer turn is a stage of its own (1 step). So:

    CriticalSteps = Σ_t (S_main^t + max_i S_sub,i^t)
    wide task of n entities split over k sub-agents:  1 + ceil(n / k) + 1
    the orchestrator alone (k = 0):                   n + 1   (deep chain of h rows: h + 1)

The budget (default 4) truncates, it never zeroes: the last step is kept for the
orchestrator's answer, sub-agents started in a stage may take `budget − used − 2` steps
(an assignment with none left fails with `err assign`, code `budget`), a sub-agent at its
limit sees `stop` and must answer with what it has, and once only the answer step is
left the orchestrator's observation ends with `stop`. A forced turn that does not answer
ends that agent with an empty answer (code `no_answer`). The partial table is scored.
With budget 4: the orchestrator alone answers 3 lookups, each sub-agent 2.

Driving an episode (the swarm runtime batches `requests()` of many episodes):

    episode = Episode(task, budget=4)
    while not episode.done:
      for request in episode.requests():          # the orchestrator, or this stage's sub-agents
        episode.submit(request.agent, policy(request.context))
    result = episode.result()                     # scores, step trace, transcripts + loss masks
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from k25jax.agents import dsl
from k25jax.agents import tools

DEFAULT_BUDGET = 4
MAX_CONTEXT = 80          # tokens per agent context in the tiny setting (budget 4, n ≤ 8)
TERMINAL_VALUE = 0        # V0 ends a deep chain
KINDS = ("wide", "deep")
KIND_SYSTEM_PROMPT = {"wide": "searcher", "deep": "follower"}


# --- hidden tables and tasks ------------------------------------------------------------

def next_entity(value: int) -> int | None:
  """The entity a value names in a deep chain (Vk → Ek), or None for the terminal V0."""
  return None if value == TERMINAL_VALUE else int(value)


def follow_chain(table: np.ndarray, attribute: int, start: int) -> tuple[tuple[int, int], ...]:
  """The rows a deep task visits: (E, table[E, attribute]) from `start` until V0 or a revisit."""
  rows, entity, seen = [], start, set()
  while entity is not None and entity not in seen:
    seen.add(entity)
    value = int(table[entity, attribute])
    rows.append((entity, value))
    entity = next_entity(value)
  return tuple(rows)


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
  """One episode's task: `kind` wide|deep, the attribute asked, `entities` (wide: the n asked;
  deep: the start), and the hidden `table` int [NUM_ENTITIES, NUM_ATTRIBUTES]."""

  kind: str
  attribute: int
  entities: tuple[int, ...]
  table: np.ndarray

  @property
  def system_prompt(self) -> str:
    return KIND_SYSTEM_PROMPT[self.kind]

  @property
  def gold(self) -> tuple[tuple[int, int], ...]:
    """The gold table as (entity, value) rows."""
    if self.kind == "deep":
      return follow_chain(self.table, self.attribute, self.entities[0])
    return tuple((e, int(self.table[e, self.attribute])) for e in self.entities)

  def lookup(self, entity: int, attribute: int) -> int:
    """The `search` tool: one cell of the hidden table."""
    return int(self.table[entity, attribute])

  def prompt(self) -> list[int]:
    """The orchestrator's prompt block, `orch SYSTEM A E.. |`."""
    return tools.format_prompt("orch", self.system_prompt, self.attribute, self.entities)


def make_task(seed, *, kind: str = "wide", n: int | None = None, hops: int | None = None,
              n_range: tuple[int, int] = (2, 8), hops_range: tuple[int, int] = (2, 3)) -> Task:
  """A task and its hidden table, deterministic given `seed` (an int or a tuple of ints).

  wide: n distinct entities (n drawn from n_range, inclusive, unless given). deep: a chain
  of `hops` rows (drawn from hops_range unless given) through distinct entities, planted
  in the table: the start is any entity, the others E1..E15 (those a value can name).
  """
  if kind not in KINDS:
    raise ValueError(f"task kind {kind!r}; choose one of {KINDS}")
  rng = np.random.default_rng(seed)
  table = rng.integers(0, dsl.NUM_VALUES, size=(dsl.NUM_ENTITIES, dsl.NUM_ATTRIBUTES)).astype(np.int32)
  attribute = int(rng.integers(dsl.NUM_ATTRIBUTES))
  if kind == "wide":
    n = int(rng.integers(n_range[0], n_range[1] + 1)) if n is None else n
    if not 1 <= n <= dsl.NUM_AGENTS:
      raise ValueError(f"a wide task asks 1..{dsl.NUM_AGENTS} entities, got n={n}")
    entities = tuple(int(e) for e in rng.choice(dsl.NUM_ENTITIES, size=n, replace=False))
    return Task(kind, attribute, entities, table)
  hops = int(rng.integers(hops_range[0], hops_range[1] + 1)) if hops is None else hops
  if not 1 <= hops <= dsl.NUM_VALUES - 1:
    raise ValueError(f"a deep task has 1..{dsl.NUM_VALUES - 1} hops, got hops={hops}")
  start = int(rng.integers(dsl.NUM_ENTITIES))
  linkable = [e for e in range(1, dsl.NUM_VALUES) if e != start]
  chain = [start, *(int(e) for e in rng.choice(linkable, size=hops - 1, replace=False))]
  for here, there in zip(chain, chain[1:]):
    table[here, attribute] = there             # the value V<there> names entity E<there>
  table[chain[-1], attribute] = TERMINAL_VALUE
  return Task(kind, attribute, (start,), table)


def sample_tasks(num: int, seed: int, *, deep_fraction: float = 0.0, **kwargs) -> list[Task]:
  """`num` tasks, each deep with probability deep_fraction; kwargs go to `make_task`."""
  if not 0.0 <= deep_fraction <= 1.0:
    raise ValueError(f"deep_fraction={deep_fraction} must be a probability")
  deep = np.random.default_rng(seed).random(num) < deep_fraction
  return [make_task((seed, i), kind="deep" if deep[i] else "wide", **kwargs) for i in range(num)]


# --- scoring ----------------------------------------------------------------------------

def normalize(cell) -> str:
  """A cell's comparable rendering: str(), whitespace runs collapsed and stripped, casefolded."""
  return " ".join(str(cell).split()).casefold()


def table_rows(pairs: Iterable[tuple[int, int]], attribute: int) -> list[dict[str, str]]:
  """(entity, value) index pairs → rows {"entity": "E5", "A2": "V3"} for `score_table`."""
  column = dsl.ATTRIBUTE.name(attribute)
  return [{"entity": dsl.ENTITY.name(e), column: dsl.VALUE.name(v)} for e, v in pairs]


@dataclasses.dataclass(frozen=True)
class TableScore:
  """WideSearch metrics of one predicted table against its gold table."""

  item_precision: float
  item_recall: float
  item_f1: float
  row_precision: float
  row_recall: float
  row_f1: float
  success: bool


def _f1(matched: int, predicted: int, gold: int) -> tuple[float, float, float]:
  """Precision, recall, F1 of `matched` out of `predicted` and `gold` items.
  Precision of an empty prediction is 1 only against an empty gold; recall of an empty gold is 1."""
  precision = matched / predicted if predicted else float(gold == 0)
  recall = matched / gold if gold else 1.0
  f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
  return precision, recall, f1


def score_table(predicted: Iterable[Mapping[str, object]], gold: Iterable[Mapping[str, object]],
                key: Sequence[str] = ("entity",)) -> TableScore:
  """Item-F1, Row-F1 and success of a predicted table (rows: column → cell).

  Rows are aligned on the `key` columns; every other column of a row is a cell. All keys,
  column names and cells compare after `normalize` (case- and whitespace-insensitive).
  * Item: each gold cell (key, column, value) can be matched by ONE predicted cell.
    precision = matched / predicted cells, recall = matched / gold cells. A duplicated
    predicted row therefore counts once for recall and its copy counts against precision
    (so do conflicting duplicates); a missing row lowers recall, an extra row precision.
  * Row: a predicted row matches a gold row when its key and all its cells equal the gold
    row's (same columns); each gold row matches once. precision/recall as for items.
  * success: every predicted row matches and every gold row is matched (the exact table).
  Gold keys must be unique (ValueError otherwise).
  """
  key = tuple(key)

  def split(row):
    row_key = tuple(normalize(row.get(k, "")) for k in key)
    cells = frozenset((normalize(c), normalize(v)) for c, v in row.items() if c not in key)
    return row_key, cells

  predicted_rows = [split(r) for r in predicted]
  gold_rows = [split(r) for r in gold]
  if len({k for k, _ in gold_rows}) != len(gold_rows):
    raise ValueError("the gold table repeats a key")
  count = lambda items: collections.Counter(items)
  item = lambda rows: count((k, c, v) for k, cells in rows for c, v in cells)
  predicted_items, gold_items = item(predicted_rows), item(gold_rows)
  matched_items = sum((predicted_items & gold_items).values())
  matched_rows = sum((count(predicted_rows) & count(gold_rows)).values())
  item_p, item_r, item_f = _f1(matched_items, sum(predicted_items.values()), sum(gold_items.values()))
  row_p, row_r, row_f = _f1(matched_rows, len(predicted_rows), len(gold_rows))
  success = matched_rows == len(predicted_rows) == len(gold_rows)
  return TableScore(item_p, item_r, item_f, row_p, row_r, row_f, success)


# --- step accounting --------------------------------------------------------------------

@dataclasses.dataclass
class StepTrace:
  """Per stage t (one orchestrator step, S_main^t = 1): the steps of each sub-agent slot
  active in it, {slot: S_sub,i^t}."""

  max_subagents: int = dsl.NUM_AGENTS
  stages: list[dict[int, int]] = dataclasses.field(default_factory=list)

  def add_stage(self, sub_steps: Mapping[int, int] | None = None) -> None:
    sub_steps = dict(sub_steps or {})
    bad = [s for s in sub_steps if not 0 <= s < self.max_subagents]
    if bad:
      raise ValueError(f"sub-agent slots {bad} are outside [0, {self.max_subagents})")
    self.stages.append(sub_steps)

  @property
  def critical_steps(self) -> int:
    """Σ_t (1 + max_i S_sub,i^t), the same number as `losses.critical_steps(*self.arrays())`."""
    return sum(1 + max(stage.values(), default=0) for stage in self.stages)

  def arrays(self, num_stages: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(main_steps int32 [T], sub_steps int32 [T, max_subagents]) in the layout of
    `losses.critical_steps`; T = num_stages (zero-padded; stages of zeros add nothing)."""
    num_stages = len(self.stages) if num_stages is None else num_stages
    if num_stages < len(self.stages):
      raise ValueError(f"the trace has {len(self.stages)} stages, more than num_stages={num_stages}")
    main = np.zeros(num_stages, np.int32)
    sub = np.zeros((num_stages, self.max_subagents), np.int32)
    for t, stage in enumerate(self.stages):
      main[t] = 1
      for slot, steps in stage.items():
        sub[t, slot] = steps
    return main, sub


def stack_traces(traces: Sequence[StepTrace], num_stages: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """A batch of traces as (main_steps [B, T], sub_steps [B, T, max_subagents]), zero-padded."""
  num_stages = max((len(t.stages) for t in traces), default=0) if num_stages is None else num_stages
  arrays = [t.arrays(num_stages) for t in traces]
  width = max((t.max_subagents for t in traces), default=dsl.NUM_AGENTS)
  main = np.zeros((len(traces), num_stages), np.int32)
  sub = np.zeros((len(traces), num_stages, width), np.int32)
  for b, (m, s) in enumerate(arrays):
    main[b], sub[b, :, :s.shape[1]] = m, s
  return main, sub


# --- the budgeted episode ---------------------------------------------------------------

@dataclasses.dataclass
class Transcript:
  """One agent context as it grew: `loss_mask` 1 on tokens the agent generated (its turns),
  0 on the environment's (prompt, observations, a `|` closing a truncated turn);
  `logprobs` as submitted for generated tokens, 0 elsewhere."""

  role: str
  agent: str
  stage: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)

  def add(self, tokens: Sequence[int], *, generated: bool, logprobs: Sequence[float] | None = None) -> None:
    tokens = [int(t) for t in tokens]
    if logprobs is None:
      logprobs = [0.0] * len(tokens)
    if len(logprobs) != len(tokens):
      raise ValueError(f"{len(logprobs)} logprobs for {len(tokens)} tokens")
    self.tokens += tokens
    self.loss_mask += [int(generated)] * len(tokens)
    self.logprobs += [float(x) for x in logprobs]

  @property
  def text(self) -> str:
    return dsl.decode(self.tokens)


@dataclasses.dataclass(frozen=True)
class Request:
  """An agent waiting for its next turn: `agent` "main" or a sub-agent name ("S1"),
  `role` orch|sub, `context` its token ids so far (generate the turn after them)."""

  agent: str
  role: str
  context: tuple[int, ...]


@dataclasses.dataclass
class _SubagentRun:
  """One assignment being worked on by a sub-agent in the current stage."""

  task: tools.AssignTask
  system_prompt: str
  transcript: Transcript
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
  none); counts feed r_parallel (num_created / num_assigned) and r_finish (num_finished /
  num_assigned); `errors` counts ToolError codes per role."""

  task: Task
  prediction: tuple[tuple[int, int], ...]
  score: TableScore
  trace: StepTrace
  forced: bool
  num_created: int
  num_assigned: int
  num_finished: int
  errors: dict[str, collections.Counter]
  orchestrator: Transcript
  subagents: list[Transcript]

  @property
  def critical_steps(self) -> int:
    return self.trace.critical_steps

  def metrics(self) -> dict[str, float]:
    """Flat floats for the logs."""
    out = {f"item_{m}": getattr(self.score, f"item_{m}") for m in ("precision", "recall", "f1")}
    out.update(row_f1=self.score.row_f1, success=float(self.score.success),
               critical_steps=float(self.critical_steps), forced=float(self.forced),
               num_created=float(self.num_created), num_assigned=float(self.num_assigned),
               num_finished=float(self.num_finished),
               errors_orch=float(sum(self.errors["orch"].values())),
               errors_sub=float(sum(self.errors["sub"].values())))
    return out


class Episode:
  """One budgeted episode: the orchestrator, the sub-agents it creates, the hidden table.

  Agents take turns through `requests()` / `submit()`; the environment parses each turn,
  runs its calls, accounts the steps and writes the observations (module docstring).
  Every sub-agent assignment is a fresh context `sub SYSTEM A E.. |` (the system prompt
  its name was created with); the orchestrator observes the rows each sub-agent answered,
  in assignment order, then its own search result, then its errors.
  """

  def __init__(self, task: Task, *, budget: int = DEFAULT_BUDGET, max_subagent_steps: int | None = None):
    if budget < 2:
      raise ValueError(f"budget={budget}: an episode needs at least 2 critical steps (a step and the answer)")
    if max_subagent_steps is not None and max_subagent_steps < 1:
      raise ValueError(f"max_subagent_steps={max_subagent_steps} must be >= 1")
    self.task = task
    self.budget = budget
    self.max_subagent_steps = max_subagent_steps
    self.trace = StepTrace()
    self.orchestrator = Transcript("orch", "main", 0)
    self.orchestrator.add(task.prompt(), generated=False)
    self.subagents: list[Transcript] = []
    self.created: dict[int, str] = {}
    self.errors = {"orch": collections.Counter(), "sub": collections.Counter()}
    self.num_assigned = 0
    self.num_finished = 0
    self.forced = False
    self.done = False
    self.prediction: tuple[tuple[int, int], ...] = ()
    self._runs: dict[int, _SubagentRun] = {}
    self._main_rows: list[tuple[int, int]] = []
    self._main_errors: list[tools.ToolError] = []
    self._main_waiting = True

  @property
  def used_steps(self) -> int:
    return self.trace.critical_steps

  def requests(self) -> list[Request]:
    """Agents waiting for a turn: the orchestrator alone, or the unfinished sub-agents of this stage."""
    if self.done:
      return []
    if self._main_waiting:
      return [Request("main", "orch", tuple(self.orchestrator.tokens))]
    return [Request(dsl.AGENT.name(slot), "sub", tuple(run.transcript.tokens))
            for slot, run in self._runs.items() if not run.done]

  def submit(self, agent: str, tokens: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
    """Gives `agent` ("main" or "S1".."S8") its generated turn: exactly the generated ids
    (up to its `|`, or all of them if it never came), with their log-probs if any."""
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

  def _record_turn(self, transcript: Transcript, parsed: tools.ParsedTurn, logprobs, role: str) -> None:
    turn_logprobs = None if logprobs is None else list(logprobs)[:len(parsed.tokens)]
    transcript.add(parsed.tokens, generated=True, logprobs=turn_logprobs)
    if not parsed.complete:
      transcript.add([dsl.EOT_ID], generated=False)
    self.errors[role].update(e.code for e in parsed.errors)

  def _error(self, role: str, code: str, tool: str | None, detail: str) -> tools.ToolError:
    self.errors[role][code] += 1
    return tools.ToolError(code, tool, detail)

  def _orchestrator_turn(self, tokens, logprobs) -> None:
    parsed = tools.parse_turn(tokens, role="orch", known_agents=self.created)
    self._record_turn(self.orchestrator, parsed, logprobs, "orch")
    self._main_waiting = False
    if parsed.answer is not None or self.forced:
      if parsed.answer is None:
        self._error("orch", "no_answer", None, "the budget forced an answer")
      self.trace.add_stage()
      self.prediction = parsed.answer.rows if parsed.answer is not None else ()
      self.done = True
      return
    self._main_rows, self._main_errors = [], list(parsed.errors)
    for call in parsed.valid:
      if isinstance(call, tools.CreateSubagent):
        self.created[call.agent] = call.system_prompt
      elif isinstance(call, tools.AssignTask):
        self._start_subagent(call)
      elif isinstance(call, tools.Search):
        self._main_rows.append((call.entity, self.task.lookup(call.entity, call.attribute)))
    if not self._runs:
      self._close_stage()

  def _start_subagent(self, call: tools.AssignTask) -> None:
    allowance = self.budget - self.used_steps - 2
    if self.max_subagent_steps is not None:
      allowance = min(allowance, self.max_subagent_steps)
    if allowance < 1:
      self._main_errors.append(self._error("orch", "budget", "assign", "no sub-agent step left"))
      return
    name, system = dsl.AGENT.name(call.agent), self.created[call.agent]
    transcript = Transcript("sub", name, len(self.trace.stages))
    transcript.add(tools.format_prompt("sub", system, call.attribute, call.entities), generated=False)
    self._runs[call.agent] = _SubagentRun(call, system, transcript, allowance)
    self.subagents.append(transcript)
    self.num_assigned += 1

  def _subagent_turn(self, run: _SubagentRun, tokens, logprobs) -> None:
    parsed = tools.parse_turn(tokens, role="sub")
    self._record_turn(run.transcript, parsed, logprobs, "sub")
    if parsed.answer is not None or run.forced:
      if parsed.answer is None:
        self._error("sub", "no_answer", None, "the budget forced an answer")
      run.rows = parsed.answer.rows if parsed.answer is not None else None
      run.done = True
    else:
      run.steps += 1
      rows = [(c.entity, self.task.lookup(c.entity, c.attribute))
              for c in parsed.valid if isinstance(c, tools.Search)]
      run.forced = run.steps >= run.allowance
      run.transcript.add(tools.format_observation(rows, parsed.errors, stop=run.forced), generated=False)
    if all(r.done for r in self._runs.values()):
      self._close_stage()

  def _close_stage(self) -> None:
    """Records the stage's steps and writes the orchestrator's observation."""
    self.trace.add_stage({slot: run.steps for slot, run in self._runs.items()})
    rows = [row for run in self._runs.values() if run.rows for row in run.rows] + self._main_rows
    self.num_finished += sum(run.finished for run in self._runs.values())
    self._runs = {}
    self.forced = self.used_steps + 1 >= self.budget
    self.orchestrator.add(tools.format_observation(rows, self._main_errors, stop=self.forced), generated=False)
    self._main_waiting = True

  def result(self) -> EpisodeResult:
    if not self.done:
      raise ValueError("the episode is still running")
    column = self.task.attribute
    score = score_table(table_rows(self.prediction, column), table_rows(self.task.gold, column))
    return EpisodeResult(self.task, self.prediction, score, self.trace, self.forced, len(self.created),
                         self.num_assigned, self.num_finished, self.errors, self.orchestrator,
                         list(self.subagents))


# --- scripted reference policies ---------------------------------------------------------

Policy = Callable[[Sequence[int]], list[int]]


def _pending_entity(view: tools.ContextView) -> int | None:
  """The next lookup a solo agent needs, or None when its task is complete."""
  if view.system_prompt == "searcher":
    return next((e for e in view.entities if view.value_of(e) is None), None)
  if not view.found:
    return view.entities[0]
  following = next_entity(view.found[-1][1])
  return None if following is None or view.value_of(following) is not None else following


def _solo_call(view: tools.ContextView) -> tools.ToolCall:
  """Search the next needed cell, or answer (when done or stopped) with the cells found."""
  entity = _pending_entity(view)
  if entity is not None and not view.stopped:
    return tools.Search(entity, view.attribute)
  if view.system_prompt == "searcher":
    rows = tuple((e, view.value_of(e)) for e in view.entities if view.value_of(e) is not None)
  else:
    rows = view.found
  return tools.Answer(rows)


def solo_policy(context: Sequence[int]) -> list[int]:
  """Scripted single agent (a sub-agent, or an orchestrator without sub-agents): one search
  per step over its entities (searcher) or along the chain (follower), then the answer."""
  return tools.render_turn([_solo_call(tools.read_context(context))])


def delegation(view: tools.ContextView, num_subagents: int) -> list[tools.ToolCall]:
  """The calls that split a task over sub-agents S1..Sk: a wide task's entities in k
  contiguous near-equal chunks (k capped at n); a deep chain to one follower."""
  if view.system_prompt == "follower":
    return [tools.CreateSubagent(0, "follower"), tools.AssignTask(0, view.attribute, view.entities[:1])]
  chunks = np.array_split(np.asarray(view.entities), min(num_subagents, len(view.entities)))
  return ([tools.CreateSubagent(slot, "searcher") for slot in range(len(chunks))]
          + [tools.AssignTask(slot, view.attribute, tuple(int(e) for e in chunk))
             for slot, chunk in enumerate(chunks)])


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


def run_episode(task: Task, orchestrator: Policy, subagent: Policy = solo_policy, *,
                budget: int = DEFAULT_BUDGET, max_subagent_steps: int | None = None) -> EpisodeResult:
  """Drives one episode with plain callables (context ids → turn ids) until it ends."""
  episode = Episode(task, budget=budget, max_subagent_steps=max_subagent_steps)
  while not episode.done:
    for request in episode.requests():
      policy = orchestrator if request.role == "orch" else subagent
      episode.submit(request.agent, policy(request.context))
  return episode.result()


def demonstrations(num_episodes: int, seed: int, *, budget: int = DEFAULT_BUDGET,
                   deep_fraction: float = 0.25, max_length: int = MAX_CONTEXT,
                   **task_kwargs) -> dict[str, np.ndarray]:
  """SFT demonstrations of both roles, from scripted policies run through the budgeted env.

  Each episode's orchestrator uses k sub-agents, k uniform in 0..n for a wide task of n
  entities and in {0, 1} for a deep one, so demos include serial, truncated and
  over-split episodes. Every context is one row (deterministic given seed):
    tokens     int32 [N, max_length]   context, then PAD
    loss_mask  float32 [N, max_length] 1 on generated tokens (the SFT targets:
               weights = loss_mask[:, 1:] for targets tokens[:, 1:])
    length     int32 [N]   role  int32 [N] (0 orchestrator, 1 sub-agent)   episode  int32 [N]
  and per episode: num_subagents, item_f1, critical_steps  [num_episodes]. The first m
  episodes of a run are the m episodes of a shorter run with the same seed.
  Raises ValueError if a context is longer than max_length.
  """
  tasks = sample_tasks(num_episodes, seed, deep_fraction=deep_fraction, **task_kwargs)
  rows, per_episode = [], collections.defaultdict(list)
  for index, task in enumerate(tasks):
    rng = np.random.default_rng((seed, index, 1))
    k = int(rng.integers(0, 2 if task.kind == "deep" else len(task.entities) + 1))
    result = run_episode(task, ScriptedOrchestrator(k), budget=budget)
    rows += [(t, index) for t in [result.orchestrator, *result.subagents]]
    per_episode["num_subagents"].append(k)
    per_episode["item_f1"].append(result.score.item_f1)
    per_episode["critical_steps"].append(result.critical_steps)
  longest = max(len(t.tokens) for t, _ in rows)
  if longest > max_length:
    raise ValueError(f"a demonstration context has {longest} tokens, more than max_length={max_length}")
  tokens = np.full((len(rows), max_length), dsl.PAD_ID, np.int32)
  loss_mask = np.zeros((len(rows), max_length), np.float32)
  for j, (transcript, _) in enumerate(rows):
    tokens[j, :len(transcript.tokens)] = transcript.tokens
    loss_mask[j, :len(transcript.tokens)] = transcript.loss_mask
  return {"tokens": tokens, "loss_mask": loss_mask,
          "length": np.array([len(t.tokens) for t, _ in rows], np.int32),
          "role": np.array([int(t.role == "sub") for t, _ in rows], np.int32),
          "episode": np.array([i for _, i in rows], np.int32),
          "num_subagents": np.array(per_episode["num_subagents"], np.int32),
          "item_f1": np.array(per_episode["item_f1"], np.float32),
          "critical_steps": np.array(per_episode["critical_steps"], np.int32)}
