"""Byte tokenizer and the pure-Python BPE over a tiktoken-format vocabulary."""
import base64

import pytest

from k25jax.data import tokenizer


def test_bytes_round_trip_and_reserved_ids():
  tok = tokenizer.ByteTokenizer()
  text = "déf f(x):\n  return x ∑ 1"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert min(ids) >= 3 and max(ids) < tok.vocab_size
  assert {tokenizer.PAD_ID, tok.bos_id, tok.eos_id} == {0, 1, 2}


def test_media_tokens_are_optional_and_decode_by_name():
  assert tokenizer.ByteTokenizer().media is None and tokenizer.ByteTokenizer().vocab_size == 259
  tok = tokenizer.load("bytes", media=True)
  assert tuple(tok.media) == (259, 260, 261, 262) and tok.vocab_size == 263
  assert tok.decode([tok.media.begin, *tok.encode("hi"), tok.media.pad, tok.media.end]) == (
      "<|media_begin|>hi<|media_pad|><|media_end|>")


def write_vocab(path, merges):
  """All 256 single bytes (rank = byte value), then `merges` in rank order."""
  tokens = [bytes([b]) for b in range(256)] + [m.encode() for m in merges]
  path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
  return {t: r for r, t in enumerate(tokens)}


def test_bpe_merges_lowest_rank_pair_first(tmp_path):
  ranks = write_vocab(tmp_path / "v.tiktoken", ["bc", "ab", "abc", "bcd"])
  tok = tokenizer.TiktokenTokenizer(str(tmp_path / "v.tiktoken"))
  # "abcd": pairs ab(257) bc(256) → a|bc|d; then abc(258) beats bcd(259) → abc|d.
  assert tok.encode("abcd") == [ranks[b"abc"], ranks[b"d"]]
  assert tok.encode("xbcd") == [ranks[b"x"], ranks[b"bcd"]]
  assert tok.decode(tok.encode("abcd xbcd!\n")) == "abcd xbcd!\n"
  assert tok.bos_id == 260 and tok.eos_id == 261 and tok.vocab_size == 262


def test_tiktoken_media_tokens_use_the_released_ids(tmp_path):
  write_vocab(tmp_path / "v.tiktoken", ["ab"])
  tok = tokenizer.load("tiktoken", str(tmp_path / "v.tiktoken"), media=True)
  assert tok.media == (163602, 163603, 163604, 163605) and tok.vocab_size == 163606
  assert tok.decode([tok.media.begin, *tok.encode("ab"), tok.media.end]) == "<|media_begin|>ab<|media_end|>"


def test_pretokenizer_keeps_words_apart(tmp_path):
  ranks = write_vocab(tmp_path / "v.tiktoken", ["ab", " ab"])
  tok = tokenizer.TiktokenTokenizer(str(tmp_path / "v.tiktoken"))
  assert tok.encode("ab ab") == [ranks[b"ab"], ranks[b" ab"]]


def test_missing_vocabulary_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no download"):
    tokenizer.load("tiktoken", str(tmp_path / "absent.tiktoken"))
  with pytest.raises(ValueError, match="vocab_file"):
    tokenizer.load("tiktoken")


def test_malformed_line_names_the_line(tmp_path):
  (tmp_path / "bad").write_text("YQ== 0\nnot-a-valid-line\n")
  with pytest.raises(ValueError, match=":2:"):
    tokenizer.read_tiktoken_ranks(str(tmp_path / "bad"))
