"""The chat format: role tokens after the base vocabulary, the loss mask, and turn parsing."""
import pytest

from k25jax.data import legacy_chat as chat, tokenizer


def test_role_tokens_follow_the_byte_and_media_vocabulary():
  tok = chat.ChatTokenizer()
  base = tokenizer.ByteTokenizer(media=True)
  assert tok.media == base.media and tok.vocab_size == 268
  assert tok.vocab_size == base.vocab_size + 5
  assert sorted(tok.special.values()) == list(range(base.vocab_size, tok.vocab_size))
  assert tok.encode("img_1") == base.encode("img_1")


def test_loss_mask_covers_exactly_the_assistant_bodies():
  tok = chat.ChatTokenizer()
  messages = [chat.Message("user", "Q?"), chat.Message("assistant", "x=1", call=True),
              chat.Message("tool", "out"), chat.Message("assistant", "7")]
  tokens, mask = chat.render(tok, messages)
  b = lambda s: tok.encode(s)
  expected = ([tok.bos_id, tok.user_id, *b("Q?"), tok.end_id, tok.assistant_id, tok.call_id, *b("x=1"), tok.end_id,
               tok.tool_id, *b("out"), tok.end_id, tok.assistant_id, *b("7"), tok.end_id])
  assert tokens == expected
  learned = [t for t, m in zip(tokens, mask) if m == 1.0]
  assert learned == [tok.call_id, *b("x=1"), tok.end_id, *b("7"), tok.end_id]
  assert set(mask) == {0.0, 1.0}
  assert tok.decode(tokens) == "<|user|>Q?<|end|><|assistant|><|call|>x=1<|end|><|tool|>out<|end|><|assistant|>7<|end|>"


def test_media_prefix_is_context():
  tok = chat.ChatTokenizer()
  tokens, mask = chat.render(tok, [chat.Message("user", "Q", prefix=(7, 7, 7))])
  assert tokens[:5] == [tok.bos_id, tok.user_id, 7, 7, 7] and not any(mask)


def test_parse_turn_reads_calls_answers_and_malformed_turns():
  tok = chat.ChatTokenizer()
  call = chat.parse_turn(tok, [tok.call_id, *tok.encode("print(1)"), tok.end_id, *tok.encode("ignored")])
  assert (call.call, call.text, call.error, len(call.tokens)) == (True, "print(1)", None, 10)
  answer = chat.parse_turn(tok, [*tok.encode(" 3 "), tok.end_id])
  assert (answer.call, answer.text, answer.error) == (False, " 3 ", None)
  assert chat.parse_turn(tok, tok.encode("print(")).error == "truncated"
  assert chat.parse_turn(tok, [tok.call_id, tok.end_id]).error == "empty"
  assert chat.parse_turn(tok, [*tok.encode("a"), tok.tool_id, tok.end_id]).error == "stray_token"
  assert chat.parse_turn(tok, [*tok.encode("a"), tok.call_id, *tok.encode("b"), tok.end_id]).error == "stray_token"


def test_bad_roles_are_refused():
  with pytest.raises(ValueError, match="Message.role"):
    chat.Message("system", "x")
  with pytest.raises(ValueError, match="call=True"):
    chat.Message("tool", "x", call=True)
