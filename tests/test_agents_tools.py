"""k25jax.agents.tools: the turn parser on valid, malformed and truncated calls; formatters."""
import pytest

from k25jax.agents import dsl, tools
from k25jax.agents.tools import Answer, AssignShare, AssignTask, CreateSubagent, Search, SearchNext


def parse(text, role="orch", known=()):
  return tools.parse_turn(dsl.encode(text), role=role, known_agents=known)


def codes(parsed):
  return [e.code for e in parsed.errors]


def test_parallel_calls_in_one_turn():
  parsed = parse("create searcher S1 S2 assign A2 S1 E1 E5 S2 E7 search A2 E9 |")
  assert parsed.complete and not parsed.errors
  assert parsed.calls == (CreateSubagent(0, "searcher"), CreateSubagent(1, "searcher"),
                          AssignTask(0, 2, (1, 5)), AssignTask(1, 2, (7,)), Search(9, 2))


def test_ungrouped_calls_parse_like_grouped_ones():
  grouped = parse("create searcher S1 S2 assign A0 S1 E3 S2 E4 |")
  separate = parse("create searcher S1 create searcher S2 assign A0 S1 E3 assign A0 S2 E4 |")
  assert grouped.calls == separate.calls


def test_answer_rows_and_empty_answer():
  assert parse("answer E1 V3 E5 V0 |", role="sub").answer == Answer(((1, 3), (5, 0)))
  assert parse("answer |").answer == Answer(())


def test_all_references_a_share_of_the_remaining_lookups_and_every_observed_cell():
  parsed = parse("create searcher S1 S2 S3 assign A1 S1 S2 S3 all |")
  assert not parsed.errors and parsed.calls[3:] == (AssignShare(0, 1, 0, 3), AssignShare(1, 1, 1, 3),
                                                    AssignShare(2, 1, 2, 3))
  assert parse("answer all |", role="sub").answer == Answer((), found=True)
  assert parse("search A3 next |", role="sub").calls == (SearchNext(3),)
  assert codes(parse("search A3 next search A1 E2 |")) == ["extra_search"]          # still one lookup a turn
  assert codes(parse("assign A1 S1 S2 all |", known={0})) == ["unknown_agent"]       # S2 was never created
  assert codes(parse("assign A1 S1 all assign A1 S1 all |", known={0, 1})) == ["busy"]
  for text in ("assign A1 S1 E2 all |", "assign A1 all S1 |", "assign A1 S1 all all |", "assign A1 S1 all S2 all |", "answer all E1 V2 |",
               "answer E1 V2 all |", "search next A3 |", "search A3 all |"):
    assert codes(parse(text, known={0, 1})) in (["arg_type"], ["arity"]), text
  assert codes(parse("assign A1 all |")) == ["arity"]


def test_all_forms_render_back_to_the_same_turn():
  for text in ("create follower S1 assign A2 S1 all |", "create searcher S1 S2 assign A0 S1 S2 all |",
               "answer all |", "assign A3 S1 E4 S2 E5 |", "search A1 next |"):
    parsed = parse(text, known=() if text.startswith("create") else {0, 1})
    assert not parsed.errors and dsl.decode(tools.render_turn(parsed.calls)) == text
  with pytest.raises(ValueError, match="share 1"):
    tools.render_turn([AssignShare(1, 0, 1, 2)])               # a share without the one before it


def test_tokens_after_end_of_turn_are_ignored():
  parsed = tools.parse_turn(dsl.encode("search A1 E2 | search A1 E3 |") + [0, 0], role="sub")
  assert parsed.calls == (Search(2, 1),) and dsl.decode(parsed.tokens) == "search A1 E2 |"


@pytest.mark.parametrize("text, code", [
    ("E5 V3 |", "unknown_tool"),
    ("obs E5 V3 search A0 E1 |", "unknown_tool"),
    ("search A0 |", "arity"),
    ("search A0 E1 E2 |", "arity"),
    ("search |", "arity"),
    ("answer E1 V3 E5 |", "arity"),
    ("create searcher |", "arity"),
    ("assign A0 S1 |", "arity"),
    ("assign A0 S1 E1 S2 |", "arity"),
    ("search E1 A0 |", "arg_type"),
    ("search A0 V3 |", "arg_type"),
    ("answer E1 E2 |", "arg_type"),
    ("create S1 searcher |", "arg_type"),
    ("assign S1 A0 E1 |", "arg_type"),
    ("assign A0 E1 S1 |", "arg_type"),
    ("assign A0 S1 V2 |", "arg_type"),
])
def test_each_malformed_call_is_one_error_with_a_reason(text, code):
  parsed = parse(text, known={0, 1})
  assert codes(parsed) == [code]
  assert parsed.errors[0].detail and parsed.errors[0].tokens


def test_malformed_call_does_not_stop_the_others():
  parsed = parse("create searcher S1 search E1 A0 assign A1 S1 E4 |")
  assert codes(parsed) == ["arg_type"]
  assert parsed.valid == (CreateSubagent(0, "searcher"), AssignTask(0, 1, (4,)))
  assert isinstance(parsed.calls[1], tools.ToolError) and parsed.calls[1].tool == "search"


def test_truncated_turn_is_one_error_and_runs_nothing():
  parsed = parse("create searcher S1 assign A0 S1 E1")
  assert not parsed.complete and codes(parsed) == ["truncated"] and not parsed.valid
  assert len(parsed.tokens) == 7


def test_agent_rules():
  assert codes(parse("assign A0 S3 E1 |")) == ["unknown_agent"]
  assert codes(parse("assign A0 S3 E1 |", known={2})) == []
  assert codes(parse("create searcher S1 assign A0 S1 E1 |")) == []          # created earlier in the turn
  assert codes(parse("assign A0 S1 E1 create searcher S1 |")) == ["unknown_agent"]
  assert codes(parse("create follower S2 |", known={1})) == ["duplicate_agent"]
  assert codes(parse("create searcher S1 S1 |")) == ["duplicate_agent"]
  assert codes(parse("assign A0 S1 E1 S1 E2 |", known={0})) == ["busy"]


def test_role_and_turn_rules():
  assert codes(parse("create searcher S1 |", role="sub")) == ["role"]
  assert codes(parse("assign A0 S1 E1 |", role="sub", known={0})) == ["role"]
  assert codes(parse("search A0 E1 search A0 E2 |", role="sub")) == ["extra_search"]
  parsed = parse("search A0 E1 answer E1 V2 answer E3 V3 |")
  assert codes(parsed) == ["with_answer", "with_answer"] and parsed.answer == Answer(((1, 2),))
  assert parsed.valid == (Answer(((1, 2),)),)


def test_parser_counts_errors_without_raising_on_any_token():
  every_token = list(range(dsl.VOCAB_SIZE))
  for role in ("orch", "sub"):
    parsed = tools.parse_turn(every_token, role=role)     # contains `|` at id 1
    assert parsed.complete and len(parsed.tokens) == 2 and codes(parsed) == ["unknown_tool"]
    parsed = tools.parse_turn(every_token[2:], role=role)
    assert not parsed.complete and codes(parsed) == ["truncated"]
  with pytest.raises(ValueError):
    tools.parse_turn([dsl.EOT_ID], role="boss")


def test_render_turn_inverts_the_parser():
  calls = (CreateSubagent(0, "searcher"), CreateSubagent(1, "searcher"), CreateSubagent(2, "follower"),
           AssignTask(0, 3, (1, 2)), AssignTask(1, 3, (4,)), AssignTask(2, 0, (9,)), Search(7, 1))
  tokens = tools.render_turn(calls)
  assert dsl.decode(tokens) == ("create searcher S1 S2 create follower S3 "
                                "assign A3 S1 E1 E2 S2 E4 assign A0 S3 E9 search A1 E7 |")
  assert tools.parse_turn(tokens, role="orch").calls == calls
  assert dsl.decode(tools.render_turn([Answer(((5, 3),))])) == "answer E5 V3 |"


def test_formatters():
  errors = parse("search A0 |").errors + parse("E1 |").errors
  assert dsl.decode(tools.format_observation([(5, 3), (17, 9)], errors, stop=True)) == \
      "obs E5 V3 E17 V9 err search err stop |"
  assert dsl.decode(tools.format_observation()) == "obs |"
  assert dsl.decode(tools.format_prompt("sub", "follower", 1, [4])) == "sub follower A1 E4 |"
  assert dsl.decode(tools.format_task(6, 2, [4, 9])) == "orch B6 A2 E4 E9 |"
  assert dsl.decode(tools.format_task(3, 0, [7], chain=True)) == "orch B3 chain A0 E7 |"
  for bad in (lambda: tools.format_prompt("sub", "searcher", 1, []), lambda: tools.format_prompt("orch", "searcher", 1, [2]),
              lambda: tools.format_task(17, 1, [2]), lambda: tools.format_task(4, 1, [2, 3], chain=True)):
    with pytest.raises(ValueError):
      bad()


def test_read_context():
  context = dsl.encode("orch B9 A2 E1 E5 E7 | V3 obs E9 | obs E5 V3 err search E9 V2 | "
                       "search A2 E1 | obs E1 V0 E5 V8 stop |")
  view = tools.read_context(context)
  assert (view.role, view.budget, view.chain, view.attribute, view.entities) == ("orch", 9, False, 2, (1, 5, 7))
  sub = tools.read_context(dsl.encode("sub follower A1 E3 |"))
  assert (sub.role, sub.system_prompt, sub.budget, sub.chain, sub.entities) == ("sub", "follower", None, True, (3,))
  assert view.found == ((5, 3), (9, 2), (1, 0))      # first sighting of each entity, the turn's `obs E9` ignored
  assert view.num_turns == 2 and view.stopped and view.value_of(7) is None
  for bad in ("search A2 E1 |", "orch searcher A2 E1 |", "orch B4 chain A2 E1 E2 |", "sub B4 A2 E1 |"):
    with pytest.raises(ValueError):
      tools.read_context(dsl.encode(bad))
