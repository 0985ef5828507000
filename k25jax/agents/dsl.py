"""The PARL token DSL: a 91-token vocabulary for the tiny wide-search swarm, and its tokenizer.

Every agent (the orchestrator or a sub-agent) sees ONE context: a sequence of blocks,
each closed by the end-of-turn token `|`. The environment writes the prompt and the
observations, the model writes the turns (the only tokens under the loss):

    context      := prompt (turn observation)* turn
    prompt       := orch BUDGET [chain] ATTRIBUTE ENTITY+ |   (the orchestrator: its task)
                  | sub SYSTEM ATTRIBUTE ENTITY+ |            (a sub-agent: its assignment)
    turn         := call* |                                  (grammar in `tools.py`)
    observation  := obs (ENTITY VALUE | err [TOOL])* [stop] |

    orch | sub           the role: which agent reads the context (the role token opens it)
    BUDGET  B2..B16      the episode's critical-step budget, shown to the orchestrator
    chain                the task verb "follow ATTRIBUTE from ENTITY" (a deep task); without
                         it the task is "give ATTRIBUTE of each ENTITY" (a wide task)
    SYSTEM  searcher | follower   a sub-agent's system prompt, chosen by the orchestrator's `create`
    ATTRIBUTE  A0..A3                ENTITY  E0..E31       VALUE  V0..V15
    TOOL       create | assign | search | answer           AGENT  S1..S8 (sub-agent names)
    all | next           references instead of spelling entities out: `assign A S1 .. Sk all`
                         splits the lookups the task still needs over the agents, `search A
                         next` makes the first of them, `answer all` answers every cell the
                         agent has observed (`tools.py`)

The orchestrator's prompt names neither its task's kind nor a sub-agent role: it says
what to find and how many critical steps it may take; whether to split is its call.

`obs` opens an observation, `err` reports a failed call (followed by the tool it was,
when known), `stop` says the critical-step budget is spent: the next turn must answer.
`_` (id 0) pads batches and never appears inside a DSL context (in the chat rendering, a
word of a model's turn that is no DSL token reads as `_`: `widesearch.rendering`). The role token doubles
as the begin marker; the vocabulary has no separator because every tool token opens a
call (see `tools.py`).

Readable text is the tokens joined by single spaces, e.g.

    orch B4 A2 E1 E5 E7 | create searcher S1 S2 assign A2 S1 E1 E5 S2 E7 |
    obs E1 V3 E5 V9 E7 V0 | answer E1 V3 E5 V9 E7 V0 |

or, with references, `create searcher S1 S2 assign A2 S1 S2 all |` (S1 gets E1 E5, S2
gets E7), `search A2 next |` and `answer all |`.

Token families with an index (entities, attributes, values, agents, budgets) are `Family`
objects: `ENTITY.id(5)` is the id of `E5`, `ENTITY.index(id)` goes back, and
`ENTITY.contains(id)` tests membership. Agents are indexed by slot 0..7 (`S1` is slot 0),
budgets by their value minus 2 (`BUDGET.id(0)` is `B2`; use `budget_id(b)`).
"""
from __future__ import annotations

import dataclasses

PAD, EOT = "_", "|"
ROLES = ("orch", "sub")
SYSTEM_PROMPTS = ("searcher", "follower")
TOOLS = ("create", "assign", "search", "answer")
OBS, ERR, STOP = "obs", "err", "stop"
CHAIN = "chain"
ALL, NEXT = "all", "next"

NUM_AGENTS = 8
NUM_ENTITIES = 32
NUM_ATTRIBUTES = 4
NUM_VALUES = 16
MIN_BUDGET, MAX_BUDGET = 2, 16   # the budgets a prompt can show (an episode needs a step and the answer)


@dataclasses.dataclass(frozen=True)
class Family:
  """An indexed token family: `size` tokens named `prefix + str(index + offset)` from id `start`."""

  prefix: str
  start: int
  size: int
  offset: int = 0

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(f"{self.prefix}{i + self.offset}" for i in range(self.size))

  def id(self, index: int) -> int:
    """The token id of member `index` (0-based)."""
    index = int(index)
    if not 0 <= index < self.size:
      raise ValueError(f"{self.prefix} index {index} is outside [0, {self.size})")
    return self.start + index

  def index(self, token_id: int) -> int:
    """The 0-based index of a member's token id."""
    if not self.contains(token_id):
      raise ValueError(f"token id {token_id} is not a {self.prefix}* token")
    return int(token_id) - self.start

  def contains(self, token_id: int) -> bool:
    return self.start <= int(token_id) < self.start + self.size

  def name(self, index: int) -> str:
    """The readable token of member `index`, e.g. AGENT.name(0) == "S1"."""
    return VOCAB[self.id(index)]


_FIXED = (PAD, EOT, *ROLES, *SYSTEM_PROMPTS, *TOOLS, OBS, ERR, STOP, CHAIN)
AGENT = Family("S", len(_FIXED), NUM_AGENTS, offset=1)
ENTITY = Family("E", AGENT.start + AGENT.size, NUM_ENTITIES)
ATTRIBUTE = Family("A", ENTITY.start + ENTITY.size, NUM_ATTRIBUTES)
VALUE = Family("V", ATTRIBUTE.start + ATTRIBUTE.size, NUM_VALUES)
BUDGET = Family("B", VALUE.start + VALUE.size, MAX_BUDGET - MIN_BUDGET + 1, offset=MIN_BUDGET)

# The references came after the families: appended, so the ids of the earlier tokens stay as they were.
VOCAB: tuple[str, ...] = (*_FIXED, *AGENT.names, *ENTITY.names, *ATTRIBUTE.names, *VALUE.names, *BUDGET.names,
                          ALL, NEXT)
VOCAB_SIZE = len(VOCAB)
TOKEN_ID: dict[str, int] = {token: i for i, token in enumerate(VOCAB)}

PAD_ID, EOT_ID = TOKEN_ID[PAD], TOKEN_ID[EOT]
ORCH_ID, SUB_ID = (TOKEN_ID[r] for r in ROLES)
SEARCHER_ID, FOLLOWER_ID = (TOKEN_ID[s] for s in SYSTEM_PROMPTS)
CREATE_ID, ASSIGN_ID, SEARCH_ID, ANSWER_ID = (TOKEN_ID[t] for t in TOOLS)
OBS_ID, ERR_ID, STOP_ID, CHAIN_ID, ALL_ID, NEXT_ID = (TOKEN_ID[t] for t in (OBS, ERR, STOP, CHAIN, ALL, NEXT))
ROLE_IDS = frozenset(TOKEN_ID[r] for r in ROLES)
SYSTEM_IDS = frozenset(TOKEN_ID[s] for s in SYSTEM_PROMPTS)
TOOL_IDS = frozenset(TOKEN_ID[t] for t in TOOLS)


def budget_id(budget: int) -> int:
  """The token of a critical-step budget (budget_id(4) is the id of `B4`)."""
  if not MIN_BUDGET <= int(budget) <= MAX_BUDGET:
    raise ValueError(f"budget {budget} is outside [{MIN_BUDGET}, {MAX_BUDGET}] (the budgets a prompt can show)")
  return BUDGET.id(int(budget) - MIN_BUDGET)


def token_id(token: str) -> int:
  """The id of one readable token, e.g. token_id("E5")."""
  try:
    return TOKEN_ID[token]
  except KeyError:
    raise ValueError(f"{token!r} is not a DSL token") from None


def token_name(token: int) -> str:
  """The readable form of one id."""
  token = int(token)
  if not 0 <= token < VOCAB_SIZE:
    raise ValueError(f"token id {token} is outside the DSL vocabulary (size {VOCAB_SIZE})")
  return VOCAB[token]


def encode(text: str) -> list[int]:
  """Whitespace-separated readable tokens → ids ("obs E1 V3 |" → [10, 22, 60, 1])."""
  return [token_id(token) for token in text.split()]


def decode(ids) -> str:
  """Ids → readable tokens joined by single spaces (the inverse of `encode`)."""
  return " ".join(token_name(i) for i in ids)


def block_body(block) -> list[int]:
  """A block's ids without its closing `|` (ValueError if it has none)."""
  block = [int(t) for t in block]
  if not block or block[-1] != EOT_ID:
    raise ValueError(f"a block ends with `|`: {decode(block)!r}")
  return block[:-1]


class DSLTokenizer:
  """The tokenizer object other stages expect: encode/decode plus the special ids."""

  vocab = VOCAB
  vocab_size = VOCAB_SIZE
  pad_id = PAD_ID
  eot_id = EOT_ID

  def encode(self, text: str) -> list[int]:
    return encode(text)

  def decode(self, ids) -> str:
    return decode(ids)
