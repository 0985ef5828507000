"""The tool protocol in the token stream: call dataclasses, the turn parser, and formatters.

A model turn is the tokens an agent generates up to and including the end-of-turn `|`.
It holds zero or more calls; each call opens with its tool token, so calls need no
separator. One call group may expand into several calls of the same tool (the
orchestrator's parallel calls in one step, written compactly):

    turn    := call* |
    call    := create SYSTEM AGENT+           create_subagent(AGENT, SYSTEM) for each AGENT
             | assign ATTRIBUTE (AGENT ENTITY+)+
                                              assign_task(AGENT, prompt = ATTRIBUTE ENTITY+)
                                              for each AGENT group
             | assign ATTRIBUTE AGENT+ all    the same, each AGENT's prompt its share of the
                                              lookups the task still needs (below)
             | search ATTRIBUTE ENTITY        search(ENTITY, ATTRIBUTE): one table lookup
             | search ATTRIBUTE next          the same, of the first lookup the task still needs
             | answer (ENTITY VALUE)*         answer(rows): ends the agent's episode
             | answer all                     answer(every cell the agent has observed)

e.g. `create searcher S1 S2 assign A2 S1 E1 E5 S2 E7 |` is four calls: two
create_subagent, then assign_task(S1, A2 E1 E5) and assign_task(S2, A2 E7).

`all` and `next` refer to entities instead of spelling them (`AssignShare`, `SearchNext`,
`Answer.found`). The lookups a task still needs are the environment's to say
(`widesearch.remaining`, from what the calling agent has observed): a wide task's
entities without a value yet, in the prompt's order; a chain's next entity. `assign A
S1 .. Sk all` gives agent i the i-th of k contiguous near-equal chunks of them
(`np.array_split`), `search A next` looks up the first, `answer all` answers every cell
the agent observed (first sighting per entity, in order); a reference to lookups when
none are left is a `nothing_left` error. So a tiny model can act without copying lists:
the 3-layer, d=96 PARL model after 1000 SFT steps copied about 10 rows reliably (Item-F1
0.37 on 16–24-entity tasks after a perfect scripted split whose hand-back it had only to
transcribe), and whether it learned to step through its prompt's entities in 600 steps
varied with the seed (Item-F1 0.26 instead of 0.61 on wide tasks, alone, at one seed);
explicit lists measured its copying, not its orchestration.

Rules of a turn (checked in order, each violation a `ToolError` in place of the call):
the orchestrator (`orch`) may use every tool, a sub-agent (`sub`) only `search` and
`answer`; an agent name is created once and must be created (earlier, or earlier in the
same turn) before it is assigned; one agent gets at most one task per turn; a turn makes
at most one `search` (one lookup per step); a turn with an `answer` is an answer turn:
its first well-formed answer is taken and every other call in it is dropped.

Parsing never raises on model output. Each malformed call becomes a `ToolError` whose
`code` is one of `ERROR_CODES` (the count goes to metrics) and whose `detail` says why;
the well-formed calls of the same turn still run. A turn without `|` (generation ran out
of tokens) is one `truncated` error and none of its calls run.

Formatters write the environment's blocks: `format_task` (the orchestrator's first block),
`format_prompt` (a sub-agent's) and
`format_observation` (what an agent sees after its turn: found cells `E V`, `err TOOL`
per failed call, `stop` when the budget is spent). `render_turn` writes calls back as a
turn (used by scripted policies), and `read_context` recovers an agent's task and the
cells it has observed so far from its context.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Iterable, Union

from k25jax.agents import dsl

ERROR_CODES = (
    "truncated",        # the turn has no end-of-turn token
    "unknown_tool",     # tokens where a call should start are not a tool token
    "arity",            # a call has too few or too many arguments
    "arg_type",         # an argument is the wrong kind of token (e.g. a value where an entity goes)
    "role",             # the tool is not available to this role (a sub-agent creating agents)
    "unknown_agent",    # assign_task to an agent that was never created
    "duplicate_agent",  # create_subagent with a name that already exists
    "busy",             # a second task for the same agent in one turn
    "extra_search",     # more than one search in one turn
    "with_answer",      # a call in the same turn as an answer (dropped)
    "budget",           # an assign_task when no sub-agent step is left in the budget (environment)
    "nothing_left",     # `assign .. all` / `search .. next` when no lookup is left for it (environment)
    "no_answer",        # the budget forced an answer and the turn did not give one (environment)
)
ROLE_TOOLS = {"orch": frozenset(dsl.TOOLS), "sub": frozenset({"search", "answer"})}


@dataclasses.dataclass(frozen=True)
class CreateSubagent:
  """create_subagent(name, system_prompt): `agent` is the slot (0 → S1), `system_prompt` a SYSTEM token."""

  agent: int
  system_prompt: str
  tool: ClassVar[str] = "create"


@dataclasses.dataclass(frozen=True)
class AssignTask:
  """assign_task(agent, prompt): the prompt is one attribute and a list of entities (indices)."""

  agent: int
  attribute: int
  entities: tuple[int, ...]
  tool: ClassVar[str] = "assign"


@dataclasses.dataclass(frozen=True)
class AssignShare:
  """assign_task(agent, prompt) by reference: the agent's prompt is chunk `share` of `shares`
  of the lookups the task still needs (resolved by the environment when the call runs)."""

  agent: int
  attribute: int
  share: int
  shares: int
  tool: ClassVar[str] = "assign"


@dataclasses.dataclass(frozen=True)
class Search:
  """search(entity, attribute): one lookup in the hidden table."""

  entity: int
  attribute: int
  tool: ClassVar[str] = "search"


@dataclasses.dataclass(frozen=True)
class SearchNext:
  """search(the first lookup the task still needs, attribute), resolved by the environment."""

  attribute: int
  tool: ClassVar[str] = "search"


@dataclasses.dataclass(frozen=True)
class Answer:
  """answer(rows): `rows` are (entity, value) index pairs, in the order written; with
  `found` (`answer all`) the rows are every cell the agent has observed instead."""

  rows: tuple[tuple[int, int], ...]
  found: bool = False
  tool: ClassVar[str] = "answer"


@dataclasses.dataclass(frozen=True)
class ToolError:
  """A call that could not run: `code` ∈ ERROR_CODES, `tool` the tool it named (None if none),
  `detail` a readable reason, `tokens` the offending token ids."""

  code: str
  tool: str | None
  detail: str
  tokens: tuple[int, ...] = ()

  def __post_init__(self):
    if self.code not in ERROR_CODES:
      raise ValueError(f"unknown tool error code {self.code!r}; codes: {ERROR_CODES}")


ToolCall = Union[CreateSubagent, AssignTask, AssignShare, Search, SearchNext, Answer]


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """A parsed turn: `calls` in the order written (ToolCall or ToolError), `tokens` the turn
  through its `|` (everything, if truncated), `complete` False when `|` was missing."""

  calls: tuple[ToolCall | ToolError, ...]
  tokens: tuple[int, ...]
  complete: bool

  @property
  def errors(self) -> tuple[ToolError, ...]:
    return tuple(c for c in self.calls if isinstance(c, ToolError))

  @property
  def valid(self) -> tuple[ToolCall, ...]:
    return tuple(c for c in self.calls if not isinstance(c, ToolError))

  @property
  def answer(self) -> Answer | None:
    """The turn's answer call, if it is an answer turn."""
    return next((c for c in self.calls if isinstance(c, Answer)), None)


# --- parsing ----------------------------------------------------------------------------

def _kind(token: int) -> str:
  """The grammatical kind of a token id: 'agent', 'entity', 'attribute', 'value', 'system' or 'other'."""
  if dsl.AGENT.contains(token):
    return "agent"
  if dsl.ENTITY.contains(token):
    return "entity"
  if dsl.ATTRIBUTE.contains(token):
    return "attribute"
  if dsl.VALUE.contains(token):
    return "value"
  if token in dsl.SYSTEM_IDS:
    return "system"
  return "other"


def _check_fixed(args: list[int], kinds: tuple[str, ...]) -> tuple[str, str] | None:
  """Positional kinds first (arg_type), then the count (arity); None when `args` fits `kinds`."""
  for position, (token, kind) in enumerate(zip(args, kinds)):
    if _kind(token) != kind:
      return "arg_type", f"argument {position + 1} is {dsl.token_name(token)!r}, expected {kind}"
  if len(args) != len(kinds):
    return "arity", f"{len(args)} arguments, expected {len(kinds)} ({' '.join(kinds)})"
  return None


def _parse_create(args: list[int]):
  if args and _kind(args[0]) != "system":
    return "arg_type", f"argument 1 is {dsl.token_name(args[0])!r}, expected a system prompt"
  for token in args[1:]:
    if _kind(token) != "agent":
      return "arg_type", f"{dsl.token_name(token)!r} is not an agent name"
  if len(args) < 2:
    return "arity", "create needs a system prompt and at least one agent name"
  system = dsl.token_name(args[0])
  return [CreateSubagent(dsl.AGENT.index(t), system) for t in args[1:]]


def _parse_assign_shares(args: list[int]):
  """`assign ATTRIBUTE AGENT+ all` (args without the trailing `all`)."""
  agents = args[1:]
  for token in agents:
    if _kind(token) != "agent":
      return "arg_type", f"{dsl.token_name(token)!r} is not an agent name (an `all` assignment lists agents only)"
  if not agents:
    return "arity", "assign .. all needs at least one agent name"
  attribute = dsl.ATTRIBUTE.index(args[0])
  return [AssignShare(dsl.AGENT.index(t), attribute, i, len(agents)) for i, t in enumerate(agents)]


def _parse_assign(args: list[int]):
  if args and _kind(args[0]) != "attribute":
    return "arg_type", f"argument 1 is {dsl.token_name(args[0])!r}, expected an attribute"
  if dsl.ALL_ID in args:
    if args[-1] != dsl.ALL_ID or args.count(dsl.ALL_ID) > 1:
      return "arg_type", "`all` must close an assign call, once"
    return _parse_assign_shares(args[:-1])
  if len(args) < 3:
    return "arity", "assign needs an attribute, then one agent name and at least one entity"
  for token in args[1:]:
    if _kind(token) not in ("agent", "entity"):
      return "arg_type", f"{dsl.token_name(token)!r} is neither an agent name nor an entity"
  if _kind(args[1]) != "agent":
    return "arg_type", f"argument 2 is {dsl.token_name(args[1])!r}, expected an agent name"
  attribute = dsl.ATTRIBUTE.index(args[0])
  calls, agent, entities = [], None, []
  for token in args[1:] + [None]:
    if token is None or _kind(token) == "agent":
      if agent is not None:
        if not entities:
          return "arity", f"agent {dsl.AGENT.name(agent)} is given no entities"
        calls.append(AssignTask(agent, attribute, tuple(entities)))
      agent, entities = (None if token is None else dsl.AGENT.index(token)), []
    else:
      entities.append(dsl.ENTITY.index(token))
  return calls


def _parse_search(args: list[int]):
  if len(args) == 2 and args[1] == dsl.NEXT_ID and _kind(args[0]) == "attribute":
    return [SearchNext(dsl.ATTRIBUTE.index(args[0]))]
  problem = _check_fixed(args, ("attribute", "entity"))
  if problem:
    return problem
  return [Search(entity=dsl.ENTITY.index(args[1]), attribute=dsl.ATTRIBUTE.index(args[0]))]


def _parse_answer(args: list[int]):
  if args == [dsl.ALL_ID]:
    return [Answer((), found=True)]
  if dsl.ALL_ID in args:
    return "arg_type", "`answer all` takes no rows"
  for position, token in enumerate(args):
    expected = "entity" if position % 2 == 0 else "value"
    if _kind(token) != expected:
      return "arg_type", f"argument {position + 1} is {dsl.token_name(token)!r}, expected {expected}"
  if len(args) % 2:
    return "arity", "answer rows are ENTITY VALUE pairs; the last entity has no value"
  rows = tuple((dsl.ENTITY.index(e), dsl.VALUE.index(v)) for e, v in zip(args[0::2], args[1::2]))
  return [Answer(rows)]


_PARSERS = {"create": _parse_create, "assign": _parse_assign, "search": _parse_search,
            "answer": _parse_answer}


def call_groups(body: list[int]) -> list[list[int]]:
  """Splits a turn body at each tool token; a leading run of non-tool tokens is its own segment."""
  segments: list[list[int]] = []
  for token in body:
    if token in dsl.TOOL_IDS or not segments:
      segments.append([token])
    else:
      segments[-1].append(token)
  return segments


def _parse_segment(segment: list[int], role: str) -> list[ToolCall | ToolError]:
  """One call group → its calls, or one error (unknown tool, role, arity, arg_type)."""
  head, args = segment[0], segment[1:]
  if head not in dsl.TOOL_IDS:
    return [ToolError("unknown_tool", None, f"{dsl.token_name(head)!r} is not a tool", tuple(segment))]
  tool = dsl.token_name(head)
  if tool not in ROLE_TOOLS[role]:
    return [ToolError("role", tool, f"role {role!r} cannot call {tool}", tuple(segment))]
  parsed = _PARSERS[tool](args)
  if isinstance(parsed, tuple):
    code, detail = parsed
    return [ToolError(code, tool, f"{tool}: {detail}", tuple(segment))]
  return parsed


def _apply_turn_rules(calls: list, known_agents: Iterable[int]) -> list[ToolCall | ToolError]:
  """The rules that span calls: agent names, one task per agent, one search, answer turns."""
  known, assigned, searched, out = set(known_agents), set(), False, []
  for call in calls:
    if isinstance(call, CreateSubagent):
      if call.agent in known:
        call = ToolError("duplicate_agent", "create", f"agent {dsl.AGENT.name(call.agent)} already exists")
      else:
        known.add(call.agent)
    elif isinstance(call, (AssignTask, AssignShare)):
      name = dsl.AGENT.name(call.agent)
      if call.agent not in known:
        call = ToolError("unknown_agent", "assign", f"agent {name} was never created")
      elif call.agent in assigned:
        call = ToolError("busy", "assign", f"agent {name} already has a task this turn")
      else:
        assigned.add(call.agent)
    elif isinstance(call, (Search, SearchNext)):
      if searched:
        call = ToolError("extra_search", "search", "one search per turn")
      searched = True
    out.append(call)
  first_answer = next((c for c in out if isinstance(c, Answer)), None)
  if first_answer is None:
    return out
  return [c if c is first_answer or isinstance(c, ToolError)
          else ToolError("with_answer", c.tool, f"{c.tool} dropped: the turn answers")
          for c in out]


def parse_turn(tokens, *, role: str, known_agents: Iterable[int] = ()) -> ParsedTurn:
  """Parses one generated turn.

  tokens: the ids the agent generated (anything after the first `|` is ignored);
  role: "orch" or "sub"; known_agents: slots created in earlier turns. Never raises on
  model output: malformed calls come back as `ToolError`s (see the module docstring).
  """
  if role not in ROLE_TOOLS:
    raise ValueError(f"role {role!r}; choose one of {tuple(ROLE_TOOLS)}")
  tokens = [int(t) for t in tokens]
  if dsl.EOT_ID not in tokens:
    error = ToolError("truncated", None, "the turn has no end-of-turn token", tuple(tokens))
    return ParsedTurn((error,), tuple(tokens), complete=False)
  end = tokens.index(dsl.EOT_ID)
  calls = [c for segment in call_groups(tokens[:end]) for c in _parse_segment(segment, role)]
  return ParsedTurn(tuple(_apply_turn_rules(calls, known_agents)), tuple(tokens[:end + 1]), complete=True)


# --- formatting -------------------------------------------------------------------------

def format_prompt(role: str, system_prompt: str, attribute: int, entities: Iterable[int]) -> list[int]:
  """`sub SYSTEM A ENTITY+ |`: a sub-agent's first block, its assignment (`role` must be "sub";
  the orchestrator's prompt is `format_task`)."""
  if role != "sub":
    raise ValueError(f"role {role!r}: format_prompt writes a sub-agent's assignment; use format_task for 'orch'")
  if system_prompt not in dsl.SYSTEM_PROMPTS:
    raise ValueError(f"system prompt {system_prompt!r}; choose one of {dsl.SYSTEM_PROMPTS}")
  return [dsl.SUB_ID, dsl.token_id(system_prompt), dsl.ATTRIBUTE.id(attribute), *_entity_ids(entities), dsl.EOT_ID]


def format_task(budget: int, attribute: int, entities: Iterable[int], chain: bool = False) -> list[int]:
  """`orch BUDGET [chain] A ENTITY+ |`: the orchestrator's task. Without `chain`: give
  attribute A of every entity (a wide task); with it: follow A from the one entity (deep)."""
  entities = _entity_ids(entities)
  if chain and len(entities) != 1:
    raise ValueError(f"a chain task starts from one entity, got {len(entities)}")
  return [dsl.ORCH_ID, dsl.budget_id(budget), *([dsl.CHAIN_ID] if chain else []), dsl.ATTRIBUTE.id(attribute),
          *entities, dsl.EOT_ID]


def _entity_ids(entities: Iterable[int]) -> list[int]:
  ids = [dsl.ENTITY.id(e) for e in entities]
  if not ids:
    raise ValueError("a prompt needs at least one entity")
  return ids


def format_observation(rows: Iterable[tuple[int, int]] = (), errors: Iterable[ToolError] = (),
                       stop: bool = False) -> list[int]:
  """`obs (E V)* (err [TOOL])* [stop] |`: found cells, one `err` per failed call, the budget flag."""
  tokens = [dsl.OBS_ID]
  for entity, value in rows:
    tokens += [dsl.ENTITY.id(entity), dsl.VALUE.id(value)]
  for error in errors:
    tokens.append(dsl.ERR_ID)
    if error.tool is not None:
      tokens.append(dsl.token_id(error.tool))
  if stop:
    tokens.append(dsl.STOP_ID)
  return tokens + [dsl.EOT_ID]


def render_turn(calls: Iterable[ToolCall]) -> list[int]:
  """Calls → a turn (ending with `|`); consecutive creates with one system prompt and
  consecutive assigns with one attribute share a call group. parse_turn inverts it."""
  tokens: list[int] = []
  previous = None
  for call in calls:
    if isinstance(call, CreateSubagent):
      if not (isinstance(previous, CreateSubagent) and previous.system_prompt == call.system_prompt):
        tokens += [dsl.CREATE_ID, dsl.token_id(call.system_prompt)]
      tokens.append(dsl.AGENT.id(call.agent))
    elif isinstance(call, AssignTask):
      if not (isinstance(previous, AssignTask) and previous.attribute == call.attribute):
        tokens += [dsl.ASSIGN_ID, dsl.ATTRIBUTE.id(call.attribute)]
      tokens += [dsl.AGENT.id(call.agent), *(dsl.ENTITY.id(e) for e in call.entities)]
    elif isinstance(call, AssignShare):
      if call.share == 0:
        tokens += [dsl.ASSIGN_ID, dsl.ATTRIBUTE.id(call.attribute)]
      elif not (isinstance(previous, AssignShare) and previous.share == call.share - 1
                and (previous.attribute, previous.shares) == (call.attribute, call.shares)):
        raise ValueError(f"share {call.share} of {call.shares} does not follow share {call.share - 1} "
                         "of the same assign call")
      tokens.append(dsl.AGENT.id(call.agent))
      if call.share == call.shares - 1:
        tokens.append(dsl.ALL_ID)
    elif isinstance(call, Search):
      tokens += [dsl.SEARCH_ID, dsl.ATTRIBUTE.id(call.attribute), dsl.ENTITY.id(call.entity)]
    elif isinstance(call, SearchNext):
      tokens += [dsl.SEARCH_ID, dsl.ATTRIBUTE.id(call.attribute), dsl.NEXT_ID]
    elif isinstance(call, Answer) and call.found:
      tokens += [dsl.ANSWER_ID, dsl.ALL_ID]
    elif isinstance(call, Answer):
      tokens.append(dsl.ANSWER_ID)
      for entity, value in call.rows:
        tokens += [dsl.ENTITY.id(entity), dsl.VALUE.id(value)]
    else:
      raise TypeError(f"cannot render {call!r} as a tool call")
    previous = call
  return tokens + [dsl.EOT_ID]


# --- reading a context ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ContextView:
  """What an agent knows from its context: its task, the cells observed so far (first
  sighting of each entity, in order), how many turns it took, and whether `stop` was seen.
  `chain`: the context asks to follow a chain (a `chain` task, or a follower's assignment);
  `budget`: the orchestrator's critical-step budget (None for a sub-agent); `system_prompt`:
  a sub-agent's (None for the orchestrator)."""

  role: str
  system_prompt: str | None
  budget: int | None
  chain: bool
  attribute: int
  entities: tuple[int, ...]
  found: tuple[tuple[int, int], ...]
  num_turns: int
  stopped: bool

  def value_of(self, entity: int) -> int | None:
    return next((v for e, v in self.found if e == entity), None)


def _blocks(tokens: list[int]) -> list[list[int]]:
  blocks, current = [], []
  for token in tokens:
    current.append(token)
    if token == dsl.EOT_ID:
      blocks.append(current)
      current = []
  if current:
    raise ValueError(f"the context ends inside a block: {dsl.decode(current)!r}")
  return blocks


def _read_prompt(prompt: list[int]) -> dict:
  """The fields of a prompt block (`format_task` or `format_prompt`); ValueError if it is neither."""
  body, ok = prompt[:-1], False
  fields = {}
  if len(body) >= 4 and body[0] == dsl.ORCH_ID and dsl.BUDGET.contains(body[1]):
    chain = body[2] == dsl.CHAIN_ID
    rest = body[3:] if chain else body[2:]
    fields = dict(role="orch", system_prompt=None, budget=dsl.BUDGET.index(body[1]) + dsl.MIN_BUDGET, chain=chain)
    ok = len(rest) >= 2 and (not chain or len(rest) == 2)
  elif len(body) >= 4 and body[0] == dsl.SUB_ID and body[1] in dsl.SYSTEM_IDS:
    system = dsl.token_name(body[1])
    fields = dict(role="sub", system_prompt=system, budget=None, chain=system == "follower")
    rest, ok = body[2:], True
  if not (ok and dsl.ATTRIBUTE.contains(rest[0]) and all(dsl.ENTITY.contains(t) for t in rest[1:])):
    raise ValueError(f"not a prompt block: {dsl.decode(prompt)!r}")
  return {**fields, "attribute": dsl.ATTRIBUTE.index(rest[0]), "entities": tuple(dsl.ENTITY.index(t) for t in rest[1:])}


def read_context(tokens) -> ContextView:
  """Reads an environment-built context (prompt, then turns and observations alternating,
  ending after an observation or the prompt). Raises ValueError on a malformed prompt."""
  blocks = _blocks([int(t) for t in tokens])
  if not blocks:
    raise ValueError("empty context")
  prompt = _read_prompt(blocks[0])
  found, seen, stopped = [], set(), False
  for block in blocks[2::2]:
    if block[0] != dsl.OBS_ID:
      raise ValueError(f"expected an observation block, got {dsl.decode(block)!r}")
    body = block[1:-1]
    for first, second in zip(body, body[1:]):
      if dsl.ENTITY.contains(first) and dsl.VALUE.contains(second):
        entity = dsl.ENTITY.index(first)
        if entity not in seen:
          seen.add(entity)
          found.append((entity, dsl.VALUE.index(second)))
    stopped = dsl.STOP_ID in body
  return ContextView(**prompt, found=tuple(found), num_turns=len(blocks[1::2]), stopped=stopped)
