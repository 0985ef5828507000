"""k25jax.agents.dsl: the vocabulary layout and the readable tokenizer."""
import pytest

from k25jax.agents import dsl


def test_vocabulary_size_and_special_ids():
  assert dsl.VOCAB_SIZE == len(set(dsl.VOCAB)) == 91
  assert dsl.PAD_ID == 0 and dsl.VOCAB[dsl.EOT_ID] == "|"
  assert (dsl.ALL_ID, dsl.NEXT_ID) == (89, 90) and dsl.decode([89, 90]) == "all next"   # appended: ids kept
  assert dsl.token_name(dsl.ORCH_ID) == "orch" and dsl.token_name(dsl.SUB_ID) == "sub"
  assert [dsl.token_name(t) for t in sorted(dsl.TOOL_IDS)] == ["create", "assign", "search", "answer"]


def test_families_are_contiguous_and_round_trip():
  for family, size, first in [(dsl.AGENT, 8, "S1"), (dsl.ENTITY, 32, "E0"),
                              (dsl.ATTRIBUTE, 4, "A0"), (dsl.VALUE, 16, "V0"), (dsl.BUDGET, 15, "B2")]:
    assert family.size == size and family.name(0) == first
    for i in range(size):
      assert family.index(family.id(i)) == i and family.contains(family.id(i))
    assert not family.contains(family.start + size) and not family.contains(family.start - 1)
  assert dsl.AGENT.name(7) == "S8" and dsl.ENTITY.name(31) == "E31" and dsl.VALUE.name(15) == "V15"
  assert dsl.token_name(dsl.budget_id(16)) == "B16" and dsl.token_name(dsl.budget_id(2)) == "B2"
  for bad in (1, 17):
    with pytest.raises(ValueError, match="budget"):
      dsl.budget_id(bad)
  with pytest.raises(ValueError):
    dsl.ENTITY.id(32)
  with pytest.raises(ValueError):
    dsl.VALUE.index(dsl.ENTITY.id(3))


def test_encode_decode_round_trip():
  text = "orch B4 A2 E1 E5 | create searcher S1 assign A2 S1 E1 E5 | obs E1 V3 E5 V9 stop |"
  ids = dsl.encode(text)
  assert dsl.decode(ids) == text
  assert ids[:3] == [dsl.ORCH_ID, dsl.budget_id(4), dsl.ATTRIBUTE.id(2)]
  tok = dsl.DSLTokenizer()
  assert tok.decode(tok.encode(" obs  E1\tV3 |")) == "obs E1 V3 |" and tok.vocab_size == 91


def test_unknown_tokens_raise():
  with pytest.raises(ValueError, match="E32"):
    dsl.encode("search A0 E32")
  with pytest.raises(ValueError):
    dsl.decode([91])
