"""Tokenizers: bytes with the chat tokens, tiktoken vocabularies through `tiktoken` (against
the pure-Python encoder it replaced), and tokenizer.json files through `tokenizers`."""
import json
import os
import sys

import pytest

from k25jax.data import chat, tokenizer, tokenizer_files

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import bench_tokenizer  # noqa: E402


def test_bytes_round_trip_and_reserved_ids():
  tok = tokenizer.ByteTokenizer()
  text = "déf f(x):\n  return x ∑ 1"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert min(ids) >= 3 and max(ids) < tok.vocab_size
  assert {tokenizer.PAD_ID, tok.bos_id, tok.eos_id} == {0, 1, 2}


def test_media_and_chat_tokens_follow_the_bytes_and_decode_by_name():
  assert tokenizer.ByteTokenizer().media is None and tokenizer.ByteTokenizer().vocab_size == 259
  tok = tokenizer.load("bytes", media=True)
  assert tuple(tok.media) == (259, 260, 261, 262) and tok.vocab_size == 263
  assert tok.decode([tok.media.begin, *tok.encode("hi"), tok.media.pad, tok.media.end]) == (
      "<|media_begin|>hi<|media_pad|><|media_end|>")
  chat = tokenizer.load("bytes", media=True, chat=True)
  assert chat.vocab_size == 275 and chat.media == tok.media
  assert [chat.special[n] for n in tokenizer.CHAT_TOKENS] == list(range(263, 275))
  assert chat.decode([chat.special["<|im_user|>"], *chat.encode("<|im_end|>")]) == "<|im_user|><|im_end|>"
  assert chat.encode("<|im_end|>") == tok.encode("<|im_end|>")     # a token's name in text is text
  with pytest.raises(ValueError, match="media=True"):
    tokenizer.ByteTokenizer(chat=True)


@pytest.fixture(scope="module")
def stdlib_vocabulary(tmp_path_factory):
  """A tiktoken file of 256 bytes + 400 merges trained on the standard library's source, and the text."""
  text = bench_tokenizer.stdlib_text(60_000)
  ranks = bench_tokenizer.train_ranks(text[:20_000], 400)
  path = bench_tokenizer.write_tiktoken(ranks, str(tmp_path_factory.mktemp("vocab") / "tiktoken.model"))
  return path, ranks, text


def test_tiktoken_gives_the_pure_python_encoders_ids_on_the_standard_library(stdlib_vocabulary):
  path, ranks, text = stdlib_vocabulary
  tok = tokenizer.load("tiktoken", path)
  ids = tok.encode(text)
  assert ids == bench_tokenizer.python_encode(text, ranks)
  assert len(ids) < len(text.encode()) * 0.6          # the merges compress the text
  assert tok.decode(ids) == text


def test_the_kimi_pattern_splits_han_runs_cases_and_digits(stdlib_vocabulary):
  import regex
  text = "你好世界HelloWorld 12345 CamelCASE"
  pieces = [m.group() for m in regex.finditer(tokenizer_files.KIMI_PATTERN, text, flags=regex.V1)]
  assert pieces == ["你好世界", "Hello", "World", " ", "123", "45", " Camel", "CASE"]
  path, ranks, _ = stdlib_vocabulary     # tiktoken splits there too: each piece encodes alone
  tok = tokenizer.load("tiktoken", path)
  assert tok.encode(text) == [i for piece in pieces for i in tok.encode(piece)] == bench_tokenizer.python_encode(
      text, ranks)


def test_a_vocabulary_of_kimis_size_gets_the_released_special_ids(tmp_path):
  """163,584 ranks (the size of Kimi's tiktoken.model): the special tokens land on the released ids."""
  tokens = [bytes([b]) for b in range(256)]
  tokens += [bytes([a, b]) for a in range(256) for b in range(256)]
  tokens += [bytes([a, b, c]) for a in range(256) for b in range(256) for c in range(2)][:163584 - len(tokens)]
  path = bench_tokenizer.write_tiktoken({t: r for r, t in enumerate(tokens)}, str(tmp_path / "tiktoken.model"))
  tok = tokenizer.load("auto", str(tmp_path), media=True)
  released = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
              "<|im_assistant|>": 163588, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
              "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
              "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601}
  assert {n: tok.special[n] for n in released} == released
  assert tuple(tok.media) == (163602, 163603, 163604, 163605)
  assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (163584, 163585, 163840)
  assert tok.special["<|reserved_token_163589|>"] == 163589 and len(tok.special) == 256
  assert tok.decode([163587, *tok.encode("hi"), 163586]) == "<|im_user|>hi<|im_end|>"
  ids, _ = chat.render_ids(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
  assert [i for i in ids if i >= 163584] == [163594, 163601, 163586, 163587, 163601, 163586, 163588, 163601,
                                            163606, 163607]     # system, user, the prompt with <think></think>
  assert path.endswith("tiktoken.model")


def test_tokenizer_config_names_the_special_tokens(stdlib_vocabulary, tmp_path):
  path, ranks, _ = stdlib_vocabulary
  os.symlink(path, tmp_path / "tiktoken.model")
  n = len(ranks)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
      str(n): {"content": "[BOS]"}, str(n + 1): {"content": "[EOS]"}, str(n + 7): {"content": "<|im_end|>"}}}))
  tok = tokenizer.load("auto", str(tmp_path))
  assert (tok.bos_id, tok.eos_id, tok.special["<|im_end|>"]) == (n, n + 1, n + 7)
  assert tok.special[f"<|reserved_token_{n + 2}|>"] == n + 2


def test_tokenizers_round_trips_a_tokenizer_json_made_here(tmp_path):
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  specials = ["[BOS]", "[EOS]", *tokenizer.CHAT_TOKENS, *tokenizer.MEDIA_TOKENS]
  trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  text = bench_tokenizer.stdlib_text(30_000)
  hf.train_from_iterator([text], trainer)
  hf.save(str(tmp_path / "tokenizer.json"))
  tok = tokenizer.load("auto", str(tmp_path), media=True)
  assert isinstance(tok, tokenizer_files.HFTokenizer)
  sample = text[:5000] + " naïve 你好 <|im_end|>"
  ids = tok.encode(sample)
  assert tok.encode(text[:5000]) == hf.encode(text[:5000], add_special_tokens=False).ids
  assert tok.decode(ids) == sample and tok.special["<|im_end|>"] not in ids      # the name in text stays text
  assert (tok.bos_id, tok.eos_id) == (hf.token_to_id("[BOS]"), hf.token_to_id("[EOS]"))
  assert tok.decode([tok.special["<|im_user|>"], *tok.encode("hi")]) == "<|im_user|>hi"
  assert tok.vocab_size == hf.get_vocab_size()


def test_missing_files_are_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no download"):
    tokenizer.load("tiktoken", str(tmp_path / "absent.tiktoken"))
  with pytest.raises(FileNotFoundError, match="neither tiktoken.model nor tokenizer.json"):
    tokenizer.load("auto", str(tmp_path))
  with pytest.raises(ValueError, match="vocab_file"):
    tokenizer.load("tiktoken")
  with pytest.raises(ValueError, match="choose"):
    tokenizer.load("sentencepiece", "x")


def test_malformed_line_names_the_line(tmp_path):
  (tmp_path / "bad").write_text("YQ== 0\nnot-a-valid-line\n")
  with pytest.raises(ValueError, match=":2:"):
    tokenizer_files.read_tiktoken_ranks(str(tmp_path / "bad"))
