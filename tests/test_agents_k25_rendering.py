"""The wide-search protocol in Kimi K2.5's chat format (widesearch/k25_rendering.py): each
context exactly what the K2.5 renderer writes for its messages, and every malformed turn read
back as an error, never an exception. (Scripted episodes end as in the DSL, and the swarm plays
them as run_episode does: tests/test_agents_rendering.py, for both chat renderings.)"""
import json

import numpy as np
import pytest

from k25jax.agents import dsl
from k25jax.agents import widesearch as ws
from k25jax.agents.widesearch import k25_rendering
from k25jax.data import chat

K25 = ws.K25Rendering()
TOK = K25.tok


def _call(name, k, arguments):
  return {"id": f"functions.{name}:{k}", "type": "function",
          "function": {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))}}


def test_an_orchestrator_context_is_the_k25_conversation_of_its_episode():
  """Byte for byte, and as chat.render_ids renders the same messages (ids and loss mask)."""
  task = ws.make_task(3, kind="wide", n=5, budget=6)
  result = ws.run_episode(task, ws.ScriptedOrchestrator(2), rendering=K25)
  attribute = dsl.ATTRIBUTE.name(task.attribute)
  entities = " ".join(dsl.ENTITY.name(e) for e in task.entities)
  found = " ".join(f"{dsl.ENTITY.name(e)} {dsl.VALUE.name(v)}" for e, v in task.gold)
  declaration = chat.render_text([], list(k25_rendering.ORCHESTRATOR_TOOLS)).split("<|im_system|>system")[0]
  assert declaration.startswith("<|im_system|>tool_declare<|im_middle|># Tools") and "type assign_task" in declaration
  expected = (
      declaration + "<|im_system|>system<|im_middle|><|im_end|>"
      f"<|im_user|>user<|im_middle|>orch B6 {attribute} {entities}<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|>"
      '<|tool_call_begin|>functions.create_subagent:0<|tool_call_argument_begin|>{"system_prompt":"searcher",'
      '"names":["S1","S2"]}<|tool_call_end|>'
      f'<|tool_call_begin|>functions.assign_task:1<|tool_call_argument_begin|>{{"attribute":"{attribute}",'
      '"agents":["S1","S2"],"entities":"all"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
      f"<|im_system|>tool<|im_middle|>## Return of functions.assign_task:1\n{found}<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|><think></think>all<|im_end|>")
  orch = result.orchestrator
  assert TOK.decode(orch.tokens) == expected
  calls = [_call("create_subagent", 0, {"system_prompt": "searcher", "names": ["S1", "S2"]}),
           _call("assign_task", 1, {"attribute": attribute, "agents": ["S1", "S2"], "entities": "all"})]
  messages = [chat.EMPTY_SYSTEM, {"role": "user", "content": f"orch B6 {attribute} {entities}"},
              {"role": "assistant", "content": "", "tool_calls": calls},
              {"role": "tool", "tool_call_id": "functions.assign_task:1", "content": found},
              {"role": "assistant", "content": "all"}]
  ids, mask = chat.render_ids(TOK, messages, list(k25_rendering.ORCHESTRATOR_TOOLS))
  assert orch.tokens == ids and orch.loss_mask == [int(m) for m in mask]
  assert result.score.item_f1 == 1.0
  sub = result.subagents[0]          # a sub-agent's context declares its one tool
  assert TOK.decode(sub.tokens).count("type search") == 1 and "create_subagent" not in TOK.decode(sub.tokens)


def test_explicit_assignments_and_lookups_are_calls_with_dsl_words_as_arguments():
  turn = K25.turn(dsl.encode("create follower S3 assign A1 S3 E4 E9 search A0 E2 |"))
  assert TOK.decode(turn) == (
      "<|tool_calls_section_begin|>"
      '<|tool_call_begin|>functions.create_subagent:0<|tool_call_argument_begin|>{"system_prompt":"follower",'
      '"names":["S3"]}<|tool_call_end|>'
      '<|tool_call_begin|>functions.assign_task:1<|tool_call_argument_begin|>{"attribute":"A1","agents":["S3"],'
      '"entities":["E4 E9"]}<|tool_call_end|>'
      '<|tool_call_begin|>functions.search:2<|tool_call_argument_begin|>{"attribute":"A0","entity":"E2"}'
      "<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
  tokens, words = K25.read_turn(turn + TOK.encode("ignored"))
  assert tokens == turn and dsl.decode(words) == "create follower S3 assign A1 S3 E4 E9 search A0 E2 |"
  assert TOK.decode(K25.turn(dsl.encode("answer E1 V3 E5 V9 |"))) == "E1 V3 E5 V9<|im_end|>"


def _section(*calls):
  body = [t for name, k, raw in calls for t in (
      TOK.special[chat.CALL_BEGIN], *TOK.encode(f"functions.{name}:{k}"), TOK.special[chat.ARGUMENT_BEGIN],
      *TOK.encode(raw), TOK.special[chat.CALL_END])]
  return [TOK.special[chat.SECTION_BEGIN], *body, TOK.special[chat.SECTION_END], K25.stop_id]


def _orchestrator_turn(generated):
  """The orchestrator's first turn `generated` on a fresh 4-entity task: (episode, its errors)."""
  episode = ws.Episode(ws.make_task(1, kind="wide", n=4, budget=6), rendering=K25)
  episode.submit("main", generated)
  return episode, dict(episode.errors["orch"])


CREATE = ("create_subagent", 0, '{"system_prompt":"searcher","names":["S1","S2"]}')


@pytest.mark.parametrize("bad_call, code", [
    (("assign_task", 1, '{"attribute":"A1","agents":"S1","entities":"all"}'), "arg_type"),     # agents not a list
    (("assign_task", 1, '{"attribute":"A1","agents":["S1"],"entities":["E1","E2"]}'), "arg_type"),  # 2 shares, 1 agent
    (("search", 1, '{"attribute":"A1"}'), "arg_type"),                                         # no entity
    (("search", 1, '{"attribute":"A1","entity":"Paris"}'), "arg_type"),                         # no DSL word
    (("search", 1, '{"attribute":3,"entity":"next"}'), "arg_type"),                             # not a string
])
def test_a_call_with_arguments_of_another_shape_fails_and_the_rest_of_the_turn_runs(bad_call, code):
  episode, errors = _orchestrator_turn(_section(CREATE, bad_call))
  assert errors == {code: 1} and episode.created == {0: "searcher", 1: "searcher"}


@pytest.mark.parametrize("generated", [
    _section(CREATE, ("python", 1, '{"code":"1"}')),                       # an undeclared tool
    _section(("search", 0, '{"attribute":"A1",')),                          # arguments not JSON
    _section(("search", 0, '["A1","next"]')),                               # JSON, not an object
    _section(("search", 0, '{"attribute":"A1","entity":"next"}'))[:-2] + [K25.stop_id],   # no section end
    [*TOK.encode("answer"), TOK.special["<|im_user|>"], K25.stop_id],        # a role token in the turn
    [TOK.special[chat.SECTION_BEGIN], TOK.special[chat.SECTION_END], K25.stop_id],        # an empty section
], ids=["undeclared_tool", "bad_json", "not_object", "unclosed_section", "stray_token", "empty_section"])
def test_a_turn_the_k25_parser_rejects_is_one_error_and_no_call_runs(generated):
  episode, errors = _orchestrator_turn(generated)
  assert errors == {"unknown_tool": 1} and not episode.created and not episode.done
  assert dsl.decode(episode.orchestrator.protocol).endswith(" | _ | obs err |")


def test_truncated_empty_and_answer_turns():
  search = _section(("search", 0, '{"attribute":"A1","entity":"next"}'))
  episode, errors = _orchestrator_turn(search[:-3])
  assert errors == {"truncated": 1}
  orch = episode.orchestrator
  end = orch.loss_mask.index(1) + len(search) - 3
  assert orch.tokens[end] == K25.stop_id and orch.loss_mask[end] == 0        # closed by the environment
  episode, errors = _orchestrator_turn([K25.stop_id])
  assert not errors and not episode.done and episode.used_steps == 1
  episode, errors = _orchestrator_turn([*TOK.encode("E1 V3"), K25.stop_id])
  assert episode.done and dsl.decode(episode.orchestrator.protocol).endswith("answer E1 V3 |")


def test_the_result_comes_back_under_the_id_the_model_wrote():
  episode, errors = _orchestrator_turn(_section(("search", 7, '{"attribute":"A1","entity":"next"}')))
  assert not errors
  assert "## Return of functions.search:7\n" in TOK.decode(episode.orchestrator.tokens)
  assert K25.observation(dsl.encode("obs stop |")) == chat.continuation_ids(
      TOK, [{"role": "tool", "tool_call_id": k25_rendering.NO_CALL_ID, "content": "stop"}])


def test_a_subagent_may_not_create_agents():
  episode = ws.Episode(ws.make_task(1, kind="wide", n=4, budget=8), rendering=K25)
  episode.submit("main", K25.turn(dsl.encode("create searcher S1 assign A1 S1 all |")))
  (request,) = episode.requests()
  episode.submit(request.agent, _section(CREATE))
  assert episode.errors["sub"]["role"] == 1


def test_k25_demonstrations_are_the_dsl_demonstrations_rendered_with_the_choice_to_split_off_the_loss():
  kw = dict(deep_fraction=0.25, delegation_share=0.3, capability_share=1.0)
  compact = ws.demonstrations(30, 4, **kw)
  rendered = ws.demonstrations(30, 4, max_length=K25.max_context, rendering=K25, **kw)
  for name in ("role", "episode", "num_subagents", "item_f1", "critical_steps"):
    np.testing.assert_array_equal(rendered[name], compact[name])
  create = [r for r in range(len(compact["tokens"])) if dsl.CREATE_ID in compact["tokens"][r]
            and compact["loss_mask"][r, list(compact["tokens"][r]).index(dsl.CREATE_ID)] == 0]
  assert create
  name = TOK.encode("functions.create_subagent")
  for r in create:
    row = list(rendered["tokens"][r])
    section = row.index(TOK.special[chat.SECTION_BEGIN])
    assert row[section + 2:section + 2 + len(name)] == name
    choice = section + 2 + len("functions.")
    assert TOK.decode([row[choice]]) == "c" and rendered["loss_mask"][r, choice] == 0
    assert rendered["loss_mask"][r, section:choice].all()      # the section and call openers are taught


def test_the_k25_format_switch_and_its_checks():
  from configs import common
  from configs import parl as parl_config
  from k25jax.stages import parl
  config = parl_config.get_config("tiny,k25_format")
  assert config.parl.rendering == "k2.5" and config.model.vocab_size == common.K25_FORMAT_VOCAB_SIZE == K25.vocab_size
  assert config.model.max_position_embeddings >= K25.max_context
  parl.check(config)
  config.model.vocab_size = common.CHAT_VOCAB_SIZE
  with pytest.raises(ValueError, match="parl.rendering='k2.5' has 275 ids"):
    parl.check(config)
  assert ws.rendering.make("k2.5").name == "k2.5"
