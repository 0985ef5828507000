"""Hidden tables and tasks of the wide-search environment.

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
"""
from __future__ import annotations

import dataclasses

import numpy as np

from k25jax.agents import dsl
from k25jax.agents import tools

DEFAULT_BUDGET = 4
MAX_CONTEXT = 80          # tokens per agent context in the tiny setting (budget 4, n ≤ 8)
TERMINAL_VALUE = 0        # V0 ends a deep chain
KINDS = ("wide", "deep")
KIND_SYSTEM_PROMPT = {"wide": "searcher", "deep": "follower"}


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
