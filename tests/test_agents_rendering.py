"""The wide-search renderings: one episode, the DSL's ids, k25jax's own chat format or Kimi K2.5's,
the same result (the K2.5 rendering's own contexts and malformed turns: tests/test_agents_k25_rendering.py)."""
import numpy as np
import pytest

from k25jax.agents import dsl, swarm, tools
from k25jax.agents import widesearch as ws
from k25jax.data import legacy_chat as chat

CHAT = ws.ChatRendering()
TOK = CHAT.tok


def _tasks():
  return ws.sample_tasks(24, 7, deep_fraction=0.25, budget_range=(3, 12))


RENDERED = [CHAT, ws.K25Rendering()]


@pytest.mark.parametrize("rendering", RENDERED, ids=["chat", "k2.5"])
@pytest.mark.parametrize("split", [0, 1, 3, 8])
def test_scripted_episodes_end_alike_in_the_dsl_and_a_chat_rendering(split, rendering):
  for task in _tasks():
    dsl_run = ws.run_episode(task, ws.ScriptedOrchestrator(split))
    chat_run = ws.run_episode(task, ws.ScriptedOrchestrator(split), rendering=rendering)
    assert chat_run.metrics() == dsl_run.metrics()
    assert chat_run.prediction == dsl_run.prediction and chat_run.trace == dsl_run.trace
    for a, b in zip([dsl_run.orchestrator, *dsl_run.subagents], [chat_run.orchestrator, *chat_run.subagents]):
      assert b.text == a.text and b.protocol == a.tokens == a.protocol


def test_a_chat_transcript_is_a_chat_conversation_with_the_loss_on_the_assistant_bodies():
  task = ws.make_task(3, kind="wide", n=5, budget=6)
  result = ws.run_episode(task, ws.ScriptedOrchestrator(2), rendering=CHAT)
  orch = result.orchestrator
  entities = " ".join(dsl.ENTITY.name(e) for e in task.entities)
  found = " ".join(f"{dsl.ENTITY.name(e)} {dsl.VALUE.name(v)}" for e, v in task.gold)
  expected = ("<|user|>orch B6 " + f"{dsl.ATTRIBUTE.name(task.attribute)} {entities}<|end|>"
              "<|assistant|><|call|>create searcher S1 S2 assign " + f"{dsl.ATTRIBUTE.name(task.attribute)} S1 S2 all<|end|>"
              f"<|tool|>obs {found}<|end|><|assistant|>answer all<|end|>")
  assert orch.tokens[0] == TOK.bos_id and TOK.decode(orch.tokens[1:]) == expected
  messages = [chat.Message("user", f"orch B6 {dsl.ATTRIBUTE.name(task.attribute)} {entities}"),
              chat.Message("assistant", f"create searcher S1 S2 assign {dsl.ATTRIBUTE.name(task.attribute)} S1 S2 all",
                           call=True),
              chat.Message("tool", f"obs {found}"), chat.Message("assistant", "answer all")]
  tokens, mask = chat.render(TOK, messages)
  # chat.render writes each header with its message; here the environment opens each turn
  assert orch.tokens == tokens and orch.loss_mask == [int(m) for m in mask]
  assert result.score.item_f1 == 1.0


def _orchestrator_turn(generated):
  """The orchestrator's first turn `generated` (chat ids) on a fresh 4-entity task: (episode, its errors)."""
  episode = ws.Episode(ws.make_task(1, kind="wide", n=4, budget=6), rendering=CHAT)
  episode.submit("main", generated)
  return episode, episode.errors["orch"]


def test_a_word_that_is_no_dsl_token_fails_its_call_and_the_rest_of_the_turn_runs():
  episode, errors = _orchestrator_turn([TOK.call_id, *TOK.encode("please create searcher S1 S2"), TOK.end_id])
  assert errors == {"unknown_tool": 1}         # the leading word is a call group of its own
  assert episode.created == {0: "searcher", 1: "searcher"}
  assert episode.orchestrator.text.split("|")[1].split() == ["_", "create", "searcher", "S1", "S2"]
  episode, errors = _orchestrator_turn([TOK.call_id, *TOK.encode("create searcher S1 S2x"), TOK.end_id])
  assert errors == {"arg_type": 1} and not episode.created   # inside a call: that call fails


def test_a_role_token_inside_a_turn_or_a_missing_end_is_one_error():
  episode, errors = _orchestrator_turn([TOK.call_id, *TOK.encode("search A1 next"), TOK.tool_id, TOK.end_id])
  assert errors == {"unknown_tool": 1} and not episode.created
  generated = [TOK.call_id, *TOK.encode("search A1 next")]
  episode, errors = _orchestrator_turn(generated)
  assert errors == {"truncated": 1}
  orch = episode.orchestrator
  start = orch.loss_mask.index(1)
  end = start + len(generated)
  assert orch.tokens[start:end] == generated and sum(orch.loss_mask) == len(generated)
  assert orch.tokens[end] == TOK.end_id and orch.loss_mask[end] == 0   # closed by the environment
  assert orch.tokens[end + 1] == TOK.tool_id


def test_an_empty_turn_is_a_turn_without_calls():
  episode, errors = _orchestrator_turn([TOK.end_id])
  assert not errors and not episode.done and episode.used_steps == 1


def test_reading_ignores_the_call_marker_and_keeps_the_generated_logprobs_of_the_turn():
  with_marker = [TOK.call_id, *TOK.encode("search A1 next"), TOK.end_id]
  without = with_marker[1:]
  for generated in (with_marker, without):
    episode = ws.Episode(ws.make_task(1, kind="wide", n=4, budget=6), rendering=CHAT)
    logprobs = list(np.linspace(-1, -0.1, len(generated) + 5))   # more than the turn: cut at its <|end|>
    episode.submit("main", generated + [TOK.user_id] * 5, logprobs)
    orch = episode.orchestrator
    start = orch.loss_mask.index(1)
    assert orch.tokens[start:start + len(generated)] == generated
    assert orch.logprobs[start:start + len(generated)] == pytest.approx(logprobs[:len(generated)])
    assert sum(orch.loss_mask) == len(generated)
    assert not episode.errors["orch"] and tools.read_context(orch.protocol).found


def test_chat_demonstrations_are_the_dsl_demonstrations_rendered():
  kw = dict(deep_fraction=0.25, delegation_share=0.3, capability_share=1.0)
  compact = ws.demonstrations(30, 4, **kw)
  rendered = ws.demonstrations(30, 4, max_length=640, rendering=CHAT, **kw)
  assert len(rendered["tokens"]) == len(compact["tokens"])
  for name in ("role", "episode", "num_subagents", "item_f1", "critical_steps"):
    np.testing.assert_array_equal(rendered[name], compact[name])
  for row in range(len(compact["tokens"])):
    n, m = compact["length"][row], rendered["length"][row]
    dsl_text = dsl.decode(compact["tokens"][row, :n]).replace(" | ", "|").replace(" |", "|")
    chat_text = TOK.decode(rendered["tokens"][row, 1:m])
    for role in ("<|user|>", "<|tool|>", "<|assistant|>", "<|call|>"):
      chat_text = chat_text.replace(role, "")
    assert chat_text.replace("<|end|>", "|") == dsl_text
  # the choice to split is off the loss in both: `create` in the DSL, its first byte after <|call|> in chat
  create = [r for r in range(len(compact["tokens"])) if dsl.CREATE_ID in compact["tokens"][r]
            and compact["loss_mask"][r, list(compact["tokens"][r]).index(dsl.CREATE_ID)] == 0]
  assert create
  for r in create:
    row = list(rendered["tokens"][r])
    first_c = row.index(TOK.call_id) + 1
    assert TOK.decode([row[first_c]]) == "c" and rendered["loss_mask"][r, first_c] == 0
    assert rendered["loss_mask"][r, first_c - 1] == 1    # <|call|> is taught


@pytest.mark.parametrize("rendering", RENDERED, ids=["chat", "k2.5"])
def test_the_swarm_plays_chat_episodes_with_scripted_policies_as_run_episode_does(rendering):
  tasks = _tasks()[:8]
  runtime = swarm.Swarm({"orch": ws.ScriptedOrchestrator(3), "sub": ws.solo_policy})
  results = runtime.run([ws.Episode(t, rendering=rendering) for t in tasks])
  for task, result in zip(tasks, results):
    alone = ws.run_episode(task, ws.ScriptedOrchestrator(3), rendering=rendering)
    assert result.metrics() == alone.metrics() and result.orchestrator.tokens == alone.orchestrator.tokens


def test_make_names_the_renderings():
  assert ws.rendering.make("dsl").vocab_size == dsl.VOCAB_SIZE
  assert ws.rendering.make("chat").vocab_size == chat.ChatTokenizer().vocab_size == 268
  assert ws.rendering.make("k2.5").vocab_size == 275
  with pytest.raises(ValueError, match="choose one of"):
    ws.rendering.make("bpe")


@pytest.mark.parametrize("rendering", [ws.DSLRendering(), CHAT, ws.K25Rendering()], ids=["dsl", "chat", "k2.5"])
def test_the_longest_demonstrations_fit_the_renderings_max_context(rendering):
  demos = ws.demonstrations(60, 2, rendering=rendering, max_length=rendering.max_context, budget_range=(16, 16),
                            n_range=(20, 24), deep_fraction=0.25, delegation_share=0.5)
  assert demos["length"].max() > rendering.max_context // 2
