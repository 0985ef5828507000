"""A run's tokenizer as the files an HF folder carries.

* `bytes`: a `tokenizer.json` written with `tokenizers` that encodes exactly as
  `ByteTokenizer` does: byte b is id b + 3 (a byte-level BPE without merges, over GPT-2's
  byte-to-character table), `[PAD]` 0, `[BOS]` 1, `[EOS]` 2, then the media and chat tokens
  at their ids; with `tokenizer_config.json` for `PreTrainedTokenizerFast`, and K2.5's chat
  template when the vocabulary has the chat tokens; a legacy-format run's (`"chat": "legacy"`)
  with its role tokens too, and no chat template (transformers gets the ids right; the
  prompt layout is `k25jax.data.chat_formats.LegacyFormat`'s).
* `tiktoken`, `tokenizers`, `auto`: the run's own files, copied (tiktoken.model or
  tokenizer.json, with tokenizer_config.json where it sits beside them).
"""
from __future__ import annotations

import json
import os
import shutil

from k25jax.data import chat, chat_formats, tokenizer as tokenizer_lib, tokenizer_files

PAD_TOKEN = "[PAD]"


def byte_characters() -> dict[int, str]:
  """GPT-2's byte -> character table (what `tokenizers`' ByteLevel uses): printable Latin-1
  bytes stand for themselves, the others for 256, 257, ... in byte order."""
  printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
  out, extra = {}, 0
  for b in range(256):
    if b in printable:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + extra)
      extra += 1
  return out


def byte_tokenizer_json(tok):
  """A `tokenizers.Tokenizer` with the ids of `tok`: a `ByteTokenizer`, or the legacy chat
  tokenizer over one."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  base = getattr(tok, "base", tok)
  specials = {PAD_TOKEN: tokenizer_lib.PAD_ID, **base.special, **tok.special}
  vocab = {**specials, **{c: b + base.offset for b, c in byte_characters().items()}}
  hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  hf.decoder = decoders.ByteLevel()
  hf.add_special_tokens([tokenizers.AddedToken(name, special=True, normalized=False)
                         for name, _ in sorted(specials.items(), key=lambda kv: kv[1])])
  return hf


def write(record: dict | None, out: str) -> list[str]:
  """Writes generation_config.json (greedy; the tokenizer's BOS/EOS where there is one) and the
  tokenizer of a run's model record (`{"name", "path", "media"}`, or None) into `out`;
  returns the files written."""
  tok = chat_formats.tokenizer_from_record(record) if record else None
  generation = {"do_sample": False} if tok is None else {"do_sample": False, "bos_token_id": tok.bos_id,
                                                         "eos_token_id": tok.eos_id}
  with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump(generation, f, indent=2)
  if tok is None:
    return ["generation_config.json"]
  return ["generation_config.json", *_tokenizer_files(record, tok, out)]


def _tokenizer_files(record: dict, tok, out: str) -> list[str]:
  name, path = record["name"], record.get("path", "")
  if name == "bytes":
    byte_tokenizer_json(tok).save(os.path.join(out, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer_lib.BOS_TOKEN,
              "eos_token": tokenizer_lib.EOS_TOKEN, "pad_token": PAD_TOKEN, "clean_up_tokenization_spaces": False,
              "model_max_length": 1 << 30}
    if "<|im_middle|>" in tok.special:
      config["chat_template"] = chat.chat_template()
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
      json.dump(config, f, indent=2)
    return ["tokenizer.json", "tokenizer_config.json"]
  source = path if not os.path.isdir(path) else next(
      os.path.join(path, f) for f in (tokenizer_files.TIKTOKEN_FILE, tokenizer_files.TOKENIZER_JSON)
      if os.path.isfile(os.path.join(path, f)))
  files = [os.path.basename(source)]
  shutil.copyfile(source, os.path.join(out, files[0]))
  beside = os.path.join(os.path.dirname(source), tokenizer_files.TOKENIZER_CONFIG)
  if os.path.isfile(beside):
    shutil.copyfile(beside, os.path.join(out, tokenizer_files.TOKENIZER_CONFIG))
    files.append(tokenizer_files.TOKENIZER_CONFIG)
  return files
