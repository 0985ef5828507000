"""Hidden tables and tasks of the wide-search environment.

Hidden table. Each episode draws a table of 32 entities × 4 attributes with values
V0..V15 (deterministic given the seed). `search A E` reveals one cell; an agent makes at
most one search per step.

Tasks (`make_task`, `sample_tasks`), each with a critical-step budget B drawn per task
(shown in the prompt; `Task.with_budget` changes it):
* wide  "give attribute A for entities E_1..E_n" (n in 2..24): prompt `orch B A E1 .. En |`;
  the gold table has one row per entity. Lookups are independent: k sub-agents can do
  k of them per step, while the orchestrator alone does one.
* deep  "follow attribute A from entity E": prompt `orch B chain A E |`. A value links to
  the entity of the same number (Vk names Ek) and V0 ends the chain (`next_entity`). The
  gold table is the chain of visited rows E→V, 4..10 hops. Each lookup needs the previous
  value, so parallelism cannot help; delegating costs one extra step (the orchestrator
  should learn NOT to spawn here).
Nothing in a prompt names the task's kind or a sub-agent role beyond the task itself.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from k25jax.agents import dsl
from k25jax.agents import tools

BUDGET_RANGE = (3, 10)    # the budgets RL tasks draw from (inclusive); prompts can show 2..16
N_RANGE = (2, 24)         # entities of a wide task
HOPS_RANGE = (4, 10)      # rows of a deep chain
MAX_CONTEXT = 160         # tokens per agent context (n ≤ 24, budget ≤ 16: at most 152)
TERMINAL_VALUE = 0        # V0 ends a deep chain
KINDS = ("wide", "deep")
KIND_SYSTEM_PROMPT = {"wide": "searcher", "deep": "follower"}   # the sub-agent role that does a kind's lookups


def next_entity(value: int) -> int | None:
  """The entity a value names in a deep chain (Vk → Ek), or None for the terminal V0."""
  return None if value == TERMINAL_VALUE else int(value)


def remaining(view: tools.ContextView) -> tuple[int, ...]:
  """The lookups an agent's task still needs, given what it has observed (what `assign .. all`
  splits, and what a scripted agent searches next): a wide task's entities without a value
  yet, in the prompt's order; a chain's next entity (its start, or the entity the last value
  found names; none once the chain ends or comes back to an entity already seen)."""
  if not view.chain:
    return tuple(e for e in view.entities if view.value_of(e) is None)
  if not view.found:
    return view.entities[:1]
  following = next_entity(view.found[-1][1])
  return () if following is None or view.value_of(following) is not None else (following,)


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
  deep: the start), the hidden `table` int [NUM_ENTITIES, NUM_ATTRIBUTES], and the
  critical-step `budget` its episode runs under."""

  kind: str
  attribute: int
  entities: tuple[int, ...]
  table: np.ndarray
  budget: int = BUDGET_RANGE[1]

  def __post_init__(self):
    dsl.budget_id(self.budget)      # raises unless a prompt can show it

  @property
  def width(self) -> int:
    """Entities asked (wide) or rows of the chain (deep): the lookups a complete answer needs."""
    return len(self.gold)

  def with_budget(self, budget: int) -> "Task":
    """The same task and table under another budget."""
    return dataclasses.replace(self, budget=int(budget))

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
    """The orchestrator's prompt block, `orch B A E.. |` (wide) or `orch B chain A E |` (deep)."""
    return tools.format_task(self.budget, self.attribute, self.entities, chain=self.kind == "deep")


def make_task(seed, *, kind: str = "wide", n: int | None = None, hops: int | None = None, budget: int | None = None,
              n_range: tuple[int, int] = N_RANGE, hops_range: tuple[int, int] = HOPS_RANGE,
              budget_range: tuple[int, int] = BUDGET_RANGE) -> Task:
  """A task and its hidden table, deterministic given `seed` (an int or a tuple of ints).

  wide: n distinct entities (n drawn from n_range, inclusive, unless given). deep: a chain
  of `hops` rows (drawn from hops_range unless given) through distinct entities, planted
  in the table: the start is any entity, the others E1..E15 (those a value can name).
  budget: drawn from budget_range (inclusive) unless given, from its own random stream,
  so a task's table and question do not depend on the budget range.
  """
  if kind not in KINDS:
    raise ValueError(f"task kind {kind!r}; choose one of {KINDS}")
  rng = np.random.default_rng(seed)
  budget_rng = np.random.default_rng((*np.atleast_1d(seed).tolist(), 7))
  budget = int(budget_rng.integers(budget_range[0], budget_range[1] + 1)) if budget is None else budget
  table = rng.integers(0, dsl.NUM_VALUES, size=(dsl.NUM_ENTITIES, dsl.NUM_ATTRIBUTES)).astype(np.int32)
  attribute = int(rng.integers(dsl.NUM_ATTRIBUTES))
  if kind == "wide":
    n = int(rng.integers(n_range[0], n_range[1] + 1)) if n is None else n
    if not 1 <= n <= dsl.NUM_ENTITIES:
      raise ValueError(f"a wide task asks 1..{dsl.NUM_ENTITIES} entities, got n={n}")
    entities = tuple(int(e) for e in rng.choice(dsl.NUM_ENTITIES, size=n, replace=False))
    return Task(kind, attribute, entities, table, budget)
  hops = int(rng.integers(hops_range[0], hops_range[1] + 1)) if hops is None else hops
  if not 1 <= hops <= dsl.NUM_VALUES - 1:
    raise ValueError(f"a deep task has 1..{dsl.NUM_VALUES - 1} hops, got hops={hops}")
  start = int(rng.integers(dsl.NUM_ENTITIES))
  linkable = [e for e in range(1, dsl.NUM_VALUES) if e != start]
  chain = [start, *(int(e) for e in rng.choice(linkable, size=hops - 1, replace=False))]
  for here, there in zip(chain, chain[1:]):
    table[here, attribute] = there             # the value V<there> names entity E<there>
  table[chain[-1], attribute] = TERMINAL_VALUE
  return Task(kind, attribute, (start,), table, budget)


def sample_tasks(num: int, seed: int, *, deep_fraction: float = 0.0, **kwargs) -> list[Task]:
  """`num` tasks, each deep with probability deep_fraction; kwargs go to `make_task`."""
  if not 0.0 <= deep_fraction <= 1.0:
    raise ValueError(f"deep_fraction={deep_fraction} must be a probability")
  deep = np.random.default_rng(seed).random(num) < deep_fraction
  return [make_task((seed, i), kind="deep" if deep[i] else "wide", **kwargs) for i in range(num)]
