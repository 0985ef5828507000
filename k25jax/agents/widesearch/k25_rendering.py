"""The wide-search protocol in Kimi K2.5's chat format (`parl.rendering=k2.5`).

Each agent's context is a K2.5 conversation (`k25jax/data/chat.py`) through the byte
tokenizer with the K2.5 chat tokens (275 ids, the vocabulary of every K2.5-format stage):

    prompt       := <|im_system|>tool_declare<|im_middle|>{the role's tools}<|im_end|>
                    <|im_system|>system<|im_middle|><|im_end|>
                    <|im_user|>user<|im_middle|>{the block's text}<|im_end|>  GEN
    turn         := SECTION<|im_end|>                      calls (the orchestrator's
                                                           create_subagent, assign_task,
                                                           search; a sub-agent's search)
                  | {rows}<|im_end|>                        an answer, as the message's content
    observation  := <|im_system|>tool<|im_middle|>## Return of {id}\\n{text}<|im_end|>  GEN
    GEN          := <|im_assistant|>assistant<|im_middle|><think></think>   (thinking off)
    SECTION      := <|tool_calls_section_begin|>(<|tool_call_begin|>functions.{tool}:{k}
                    <|tool_call_argument_begin|>{JSON}<|tool_call_end|>)+<|tool_calls_section_end|>

The prompt's text is the DSL block's (`orch B4 A2 E1 E5 E7`, `sub searcher A2 E1 E5`), as
is an answer's (`E1 V3 E5 V9`, or `all`) and an observation's without its `obs` (`E1 V3`,
`err search`, `stop`): the content is the DSL's words, the protocol around it Kimi's. Each
DSL call group is one tool call, `k` its place in the turn, its arguments DSL words:

    create searcher S1 S2          create_subagent {"system_prompt": "searcher", "names": ["S1", "S2"]}
    assign A2 S1 E1 E5 S2 E7       assign_task {"attribute": "A2", "agents": ["S1", "S2"],
                                                "entities": ["E1 E5", "E7"]}
    assign A2 S1 S2 all            assign_task {"attribute": "A2", "agents": ["S1", "S2"], "entities": "all"}
    search A2 E1 / search A2 next  search {"attribute": "A2", "entity": "E1"} / {..., "entity": "next"}

A turn's observation is one tool result, under the id of the turn's last call as the model
wrote it (the hand-back of its assignments, its lookup, its errors): `functions.error:0`
after a turn without a readable call. Reading a turn back never raises: a call whose
arguments do not have these shapes reads as its tool word and `_` (an `arg_type` error
of that call; the turn's other calls run), a word that is no DSL token as `_`; a turn the
K2.5 parser rejects (a stray special token, an unclosed section, arguments that are not a
JSON object, an undeclared tool, ...) is one error (`_ |`); no `<|im_end|>` is a truncated
turn; an empty one is an empty turn.
"""
from __future__ import annotations

import json
from typing import Sequence

from k25jax.agents import dsl, tools
from k25jax.data import chat, tokenizer as tokenizer_lib

NO_CALL_ID = "functions.error:0"


def _tool(name: str, description: str, properties: dict) -> dict:
  return {"type": "function", "function": {"name": name, "description": description, "parameters": {
      "type": "object", "properties": properties, "required": list(properties)}}}


_WORDS = {"type": "array", "items": {"type": "string"}}
SEARCH = _tool("search", "Look up an attribute of an entity (or of the next one the task still needs).",
               {"attribute": {"type": "string"}, "entity": {"type": "string"}})
ORCHESTRATOR_TOOLS = (
    _tool("create_subagent", "Create sub-agents with a system prompt.",
          {"system_prompt": {"type": "string", "enum": list(dsl.SYSTEM_PROMPTS)}, "names": _WORDS}),
    _tool("assign_task", "Give each agent its entities to look up (or 'all': a share of what is left).",
          {"attribute": {"type": "string"}, "agents": _WORDS, "entities": {"anyOf": [_WORDS, {"type": "string"}]}}),
    SEARCH)
SUBAGENT_TOOLS = (SEARCH,)
TOOL_WORDS = {"create_subagent": "create", "assign_task": "assign", "search": "search"}
_TOOL_NAMES = {word: name for name, word in TOOL_WORDS.items()}


def _words(block: Sequence[int]) -> list[str]:
  """A DSL block's words, without its `|`."""
  return dsl.decode(dsl.block_body(block)).split()


def _arguments(group: list[str]) -> dict:
  """A DSL call group (create / assign / search) as its tool call's arguments."""
  tool, args = group[0], group[1:]
  if tool == "create":
    return {"system_prompt": args[0], "names": args[1:]}
  if tool == "search":
    return {"attribute": args[0], "entity": args[1]}
  attribute, rest = args[0], args[1:]
  if rest[-1] == dsl.ALL:
    return {"attribute": attribute, "agents": rest[:-1], "entities": dsl.ALL}
  agents, entities = [], []
  for word in rest:
    if word in dsl.AGENT.names:
      agents.append(word)
      entities.append([])
    else:
      entities[-1].append(word)
  return {"attribute": attribute, "agents": agents, "entities": [" ".join(e) for e in entities]}


def _strings(value) -> list[str] | None:
  return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def _call_words(name: str, arguments: dict) -> list[str]:
  """A parsed tool call as DSL words; arguments of another shape give the tool word and `_`."""
  word = TOOL_WORDS[name]
  if name == "search":
    attribute, entity = arguments.get("attribute"), arguments.get("entity")
    ok = isinstance(attribute, str) and isinstance(entity, str)
    return [word, attribute, entity] if ok else [word, dsl.PAD]
  if name == "create_subagent":
    system, names = arguments.get("system_prompt"), _strings(arguments.get("names"))
    return [word, system, *names] if isinstance(system, str) and names else [word, dsl.PAD]
  attribute, agents, entities = arguments.get("attribute"), _strings(arguments.get("agents")), arguments.get("entities")
  if not isinstance(attribute, str) or not agents:
    return [word, dsl.PAD]
  if entities == dsl.ALL:
    return [word, attribute, *agents, dsl.ALL]
  entities = _strings(entities)
  if entities is None or len(entities) != len(agents):
    return [word, dsl.PAD]
  return [word, attribute, *(w for agent, share in zip(agents, entities) for w in (agent, *share.split()))]


def _ids(words: Sequence[str]) -> list[int]:
  """DSL ids of words (each may hold several, space-separated); a word that is none reads as `_`."""
  return [dsl.TOKEN_ID.get(w, dsl.PAD_ID) for word in words for w in str(word).split()]


class K25Rendering:
  """The wide-search protocol in Kimi K2.5's chat format (module docstring)."""

  name = "k2.5"
  max_context = 2560   # the longest scripted context seen is ~2,440 ids (budget 16, 24 entities)

  def __init__(self):
    self.tok = tokenizer_lib.ByteTokenizer(media=True, chat=True)
    self.vocab_size = self.tok.vocab_size
    self.pad_id = tokenizer_lib.PAD_ID
    self.stop_id = self.tok.special[chat.IM_END]
    self._section = self.tok.special[chat.SECTION_BEGIN]
    self._name_offset = 2 + len(self.tok.encode("functions."))   # section, call begin, "functions."

  def prompt(self, block):
    words = _words(block)
    tools = ORCHESTRATOR_TOOLS if words[0] == "orch" else SUBAGENT_TOOLS
    messages = [chat.EMPTY_SYSTEM, {"role": "user", "content": " ".join(words)}]
    return chat.render_ids(self.tok, messages, list(tools), add_generation_prompt=True)[0]

  def observation(self, block, turn=()):
    words = _words(block)
    calls = chat.parse_assistant(self.tok, turn, tools=list(ORCHESTRATOR_TOOLS)).tool_calls if turn else ()
    result = {"role": "tool", "tool_call_id": calls[-1].id if calls else NO_CALL_ID,
              "content": " ".join(words[1:] if words[:1] == [dsl.OBS] else words)}
    return chat.continuation_ids(self.tok, [result])

  def turn(self, block):
    groups = [dsl.decode(g).split() for g in tools.call_groups(dsl.block_body(block))]
    answer = next((g for g in groups if g[0] == "answer"), None)
    if answer is not None:
      message = {"role": "assistant", "content": " ".join(answer[1:])}
    else:
      message = {"role": "assistant", "content": "", "tool_calls": [
          {"id": f"functions.{_TOOL_NAMES[g[0]]}:{k}", "type": "function",
           "function": {"name": _TOOL_NAMES[g[0]], "arguments": json.dumps(_arguments(g), separators=(",", ":"))}}
          for k, g in enumerate(groups)]}
    ids, mask = chat.render_ids(self.tok, [message])
    return [i for i, m in zip(ids, mask) if m]

  def read_turn(self, generated):
    parsed = chat.parse_assistant(self.tok, generated, tools=list(ORCHESTRATOR_TOOLS))
    tokens = list(parsed.tokens)
    if parsed.error == "truncated":
      return tokens, []
    if parsed.error == "empty":
      return tokens, [dsl.EOT_ID]
    if parsed.error:
      return tokens, [dsl.PAD_ID, dsl.EOT_ID]
    if parsed.tool_calls:
      return tokens, [*_ids(w for c in parsed.tool_calls for w in _call_words(c.name, c.arguments)), dsl.EOT_ID]
    return tokens, [dsl.token_id("answer"), *_ids(parsed.content.split()), dsl.EOT_ID]

  def close(self):
    return [self.stop_id]

  def choice_offset(self, turn: Sequence[int]) -> int:
    """Where a generated turn makes its first decision: the first byte of its first call's
    tool name (`c` of create_subagent, `s` of search), or of an answer's content."""
    return self._name_offset if list(turn[:1]) == [self._section] else 0
