"""SFT on the user's chats (`data.source=files`, k25jax/data/chat_files.py, k25jax/train/chat_rows.py):
records with tools, tool calls, results, reasoning and images rendered as the K2.5 renderer
renders their messages, JSONL / gzip JSONL / Parquet, every bad record in one line naming the
file and line (or skipped and counted), the packed rows with their media, and the stage end to
end: the held-out loss falls and a bad file exits 2."""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from cpu_env import subprocess_env
from PIL import Image

from k25jax.data import chat, chat_files, files, tokenizer, vision

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = tokenizer.ByteTokenizer(media=True, chat=True)
TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run Python code.",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                          "required": ["code"]}}}]
RENDERING = chat_files.Rendering(TOK, thinking=False, max_length=512, max_patches=16)


def _image(path, colour, size=28):
  pixels = np.zeros((size, size, 3), np.uint8)
  pixels[:] = colour
  Image.fromarray(pixels).save(path)
  return str(path)


def _write_jsonl(path, records, opener=open):
  with opener(path, "wt", encoding="utf-8") as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


def _data(**overrides):
  from configs import sft as sft_config
  data = sft_config.get_config("tiny,files").data
  data.update(overrides)
  return data


def _tool_chat(a, b):
  """A chat that calls the declared python tool twice, reads the results, then answers."""
  calls = [{"id": "functions.python:0", "type": "function",
            "function": {"name": "python", "arguments": json.dumps({"code": f"x = {a} * {b}"})}},
           {"id": "functions.python:1", "type": "function", "function": {"name": "python",
                                                                         "arguments": {"code": "print(x)"}}}]
  return {"messages": [{"role": "user", "content": f"What is {a} times {b}?"},
                       {"role": "assistant", "content": "", "reasoning_content": "Compute it.", "tool_calls": calls},
                       {"role": "tool", "tool_call_id": "functions.python:0", "content": ""},
                       {"role": "tool", "tool_call_id": "functions.python:1", "content": str(a * b)},
                       {"role": "assistant", "content": str(a * b), "reasoning_content": "Read it off."}],
          "tools": TOOLS}


def _image_chat(path, colour_name):
  return {"messages": [{"role": "system", "content": "Answer in one word."},
                       {"role": "user", "content": [{"type": "image", "image": os.path.basename(path)},
                                                    {"type": "text", "text": "Which colour?"}]},
                       {"role": "assistant", "content": colour_name}]}


# ------------------------------------------------------------------------------ rendering
@pytest.mark.parametrize("thinking", [False, True])
def test_a_record_renders_as_the_k25_renderer_renders_its_messages(tmp_path, thinking):
  """Tool declaration, two calls (arguments as JSON text and as an object), their results,
  reasoning: ids and mask are chat.render_ids' of the same messages; the mask is 1 only on the
  assistant's turns."""
  record = _tool_chat(12, 34)
  how = chat_files.Rendering(TOK, thinking, 512, 16)
  ids, mask, images = chat_files.render(record, str(tmp_path), how)
  expected = json.loads(json.dumps(record))
  for call in expected["messages"][1]["tool_calls"]:
    if isinstance(call["function"]["arguments"], str):
      call["function"]["arguments"] = json.loads(call["function"]["arguments"])
  want_ids, want_mask = chat.render_ids(TOK, expected["messages"], TOOLS, thinking=thinking)
  assert (ids, mask, images) == (want_ids, want_mask, [])
  text = TOK.decode(ids)
  assert text == chat.render_text(expected["messages"], TOOLS, thinking=thinking)
  assert text.startswith("<|im_system|>tool_declare<|im_middle|># Tools")
  assert '<|tool_call_begin|>functions.python:1<|tool_call_argument_begin|>{"code": "print(x)"}<|tool_call_end|>' in text
  assert ("Read it off.</think>408<|im_end|>" in text) == thinking
  learned = TOK.decode([i for i, m in zip(ids, mask) if m])
  assert "What is 12 times 34?" not in learned and "## Return of" not in learned and "408<|im_end|>" in learned


def test_an_image_part_becomes_its_media_block_and_its_pixels(tmp_path):
  """`{"type": "image", "image": PATH}` (relative to the file): the image is preprocessed within
  the patch budget and rendered as `tokens` placeholders; the media go with the chat in order."""
  path = _image(tmp_path / "red.png", (255, 0, 0), size=70)
  ids, mask, images = chat_files.render(_image_chat(path, "red"), str(tmp_path), RENDERING)
  media = vision.preprocess_image(path, max_patches=16)
  assert len(images) == 1 and np.array_equal(images[0].pixel_values, media.pixel_values)
  assert images[0].grid_thw == media.grid_thw and images[0].pixel_values.shape[0] <= 16
  messages = [{"role": "system", "content": "Answer in one word."},
              {"role": "user", "content": [{"type": "image", "tokens": media.num_tokens},
                                           {"type": "text", "text": "Which colour?"}]},
              {"role": "assistant", "content": "red"}]
  assert (ids, mask) == chat.render_ids(TOK, messages)
  assert ids.count(TOK.special[tokenizer.MEDIA_TOKENS.pad]) == media.num_tokens
  assert TOK.decode([i for i, m in zip(ids, mask) if m]) == "red<|im_end|>"


def test_jsonl_gzip_and_parquet_records_read_alike(tmp_path):
  """The same chats from .jsonl, .jsonl.gz and .parquet (tools as a column of JSON text)."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  records = [{"messages": [{"role": "user", "content": f"{a}+{a}="}, {"role": "assistant", "content": str(2 * a)}]}
             for a in range(5)] + [_tool_chat(3, 4)]
  plain = _write_jsonl(tmp_path / "c.jsonl", records)
  zipped = _write_jsonl(tmp_path / "c.jsonl.gz", records, gzip.open)
  rows = [{"messages": json.loads(json.dumps(r["messages"])), "tools": json.dumps(r["tools"]) if "tools" in r else None}
          for r in records]
  for row in rows:   # one schema for every row: arguments as JSON text
    for m in row["messages"]:
      for call in m.get("tool_calls", []):
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"]) if isinstance(
            call["function"]["arguments"], dict) else call["function"]["arguments"]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
  read = {name: chat_files.read(str(tmp_path / name), "data.files", RENDERING, files.BadRecords())
          for name in ("c.jsonl", "c.jsonl.gz", "c.parquet")}
  assert [c.where for c in read["c.jsonl"]] == [f"{plain}:{i}" for i in range(1, 7)]
  assert read["c.jsonl.gz"][5].where == f"{zipped}:6" and read["c.parquet"][5].where.endswith("c.parquet:row 5")
  for name in ("c.jsonl.gz", "c.parquet"):
    assert all(np.array_equal(a.ids, b.ids) and np.array_equal(a.loss_mask, b.loss_mask)
               for a, b in zip(read["c.jsonl"], read[name]))


def test_held_out_chats_come_from_eval_files_or_every_kth_record(tmp_path):
  records = [{"messages": [{"role": "user", "content": str(i)}, {"role": "assistant", "content": "ok"}]}
             for i in range(10)]
  path = _write_jsonl(tmp_path / "c.jsonl", records)
  train, held = chat_files.load(_data(files=path, eval_every=4), RENDERING)
  assert [c.where.rsplit(":", 1)[1] for c in held] == ["4", "8"] and len(train) == 8
  other = _write_jsonl(tmp_path / "held.jsonl", records[:3])
  train, held = chat_files.load(_data(files=path, eval_files=other), RENDERING)
  assert len(train) == 10 and [c.where for c in held] == [f"{other}:{i}" for i in (1, 2, 3)]
  with pytest.raises(files.BadData, match="must hold out some and leave some to train on"):
    chat_files.load(_data(files=path, eval_every=11), RENDERING)


# ------------------------------------------------------------------------------ bad input
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD_RECORDS = [
    ('[1, 2]', "not a JSON object"),
    ({"prompt": "hi"}, "needs 'messages': a non-empty list"),
    ({"messages": []}, "needs 'messages': a non-empty list"),
    ({"messages": ["hi"]}, "messages[0] is not an object"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0] has role 'bot'"),
    ({"messages": [{"role": "user", "content": 3}, GOOD["messages"][1]]}, "messages[0].content must be text or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}, GOOD["messages"][1]]}, "a part must be"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]}, GOOD["messages"][1]]},
     "image 'nope.png' does not exist"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "broken.png"}]}, GOOD["messages"][1]]},
     "image 'broken.png' does not open"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, GOOD["messages"][1]]},
     "an image part needs 'image': a path"),
    ({"messages": [GOOD["messages"][0], {"role": "assistant", "content": [{"type": "image", "image": "red.png"}]}]},
     "an assistant turn holds no image"),
    ({"messages": [GOOD["messages"][0], {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "tool_calls[0] needs 'function'"),
    ({"messages": [GOOD["messages"][0], {"role": "assistant", "tool_calls": [
        {"function": {"name": "python", "arguments": "{not json"}}]}], "tools": TOOLS}, "arguments are not JSON"),
    ({"messages": [GOOD["messages"][0], {"role": "assistant", "tool_calls": [
        {"function": {"name": "python", "arguments": "[1]"}}]}], "tools": TOOLS}, "arguments must be a JSON object"),
    ({"messages": [GOOD["messages"][0], {"role": "assistant", "tool_calls": [
        {"function": {"name": "shell", "arguments": {}}}]}], "tools": TOOLS}, "calls 'shell', which the record's tools"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
                   GOOD["messages"][1]]}, "only assistant turns make tool calls"),
    ({"messages": [GOOD["messages"][0], {"role": "tool", "content": "3"}, GOOD["messages"][1]]},
     "a tool result needs 'tool_call_id'"),
    ({"messages": GOOD["messages"], "tools": [{"type": "function", "function": {"description": "no name"}}]},
     "'tools' cannot be declared"),
    ({"messages": GOOD["messages"], "tools": "{oops"}, "'tools' is text but not JSON"),
    ({"messages": [GOOD["messages"][0]]}, "no assistant turn: nothing to learn"),
    ({"messages": [GOOD["messages"][0], {"role": "assistant", "content": "x" * 600}]},
     "more than data.max_length=512"),
    ("{not json", "not JSON (Expecting property name"),
]


@pytest.mark.parametrize("record, message", BAD_RECORDS, ids=[m.split(" (")[0][:40] for _, m in BAD_RECORDS])
def test_a_bad_record_is_one_line_naming_its_file_and_line_or_is_skipped_and_counted(tmp_path, record, message):
  _image(tmp_path / "red.png", (255, 0, 0))
  (tmp_path / "broken.png").write_bytes(b"not a png")
  path = _write_jsonl(tmp_path / "c.jsonl", [GOOD, record, GOOD])
  with pytest.raises(files.BadData) as error:
    chat_files.read(path, "data.files", RENDERING, files.BadRecords("error"))
  assert str(error.value).startswith(f"{path}:2: ") and message in str(error.value) and "\n" not in str(error.value)
  bad = files.BadRecords("skip")
  kept = chat_files.read(path, "data.files", RENDERING, bad)
  assert [c.where for c in kept] == [f"{path}:1", f"{path}:3"] and len(bad.messages) == 1


def test_files_that_give_nothing_stop_the_run(tmp_path):
  with pytest.raises(files.BadData, match="matches no file"):
    chat_files.load(_data(files=str(tmp_path / "none*.jsonl")), RENDERING)
  path = _write_jsonl(tmp_path / "c.jsonl", [{"messages": [GOOD["messages"][0]]}])
  with pytest.raises(files.BadData, match="no usable chat record"):
    chat_files.load(_data(files=path, on_bad_record="skip"), RENDERING)
  (tmp_path / "t.jsonl.gz").write_bytes(b"\x1f\x8b\x08broken")
  with pytest.raises(files.BadData, match="unreadable"):
    chat_files.load(_data(files=str(tmp_path / "t.jsonl.gz")), RENDERING)


# ----------------------------------------------------------------------------- packed rows
def _chats(tmp_path, n_text=12, n_image=6):
  red, blue = _image(tmp_path / "red.png", (255, 0, 0)), _image(tmp_path / "blue.png", (0, 0, 255), size=42)
  records = [_tool_chat(a, a + 1) for a in range(n_text)] + [
      _image_chat(red if i % 2 else blue, "red" if i % 2 else "blue") for i in range(n_image)]
  return chat_files.read(_write_jsonl(tmp_path / "c.jsonl", records), "data.files", RENDERING, files.BadRecords())


def test_rows_carry_their_chats_images_and_held_out_rows_come_once(tmp_path):
  """Each step: `batch` text rows then `visual_batch` image rows of one shape, the media in
  placeholder order (k25.check_media holds), drawn by (seed, step); held-out batches take every
  held-out row once: their loss tokens are exactly the held-out chats' learned tokens."""
  from configs import sft as sft_config
  from k25jax.train import chat_rows, config_utils
  cfg = config_utils.k25_config_from(sft_config.get_config("tiny,files").model, TOK)
  chats = _chats(tmp_path, n_text=12, n_image=24)   # image chats of 75-79 tokens: 5 to a row of 511
  rows = chat_rows.ChatRows(chats[:10] + chats[12:32], chats[10:12] + chats[32:], length=512, batch=2,
                            visual_batch=2, pad_id=0, cfg=cfg, seed=3)
  first, again, other = rows(5), rows(5), rows(6)
  assert all(np.array_equal(first[k], again[k]) for k in ("inputs", "loss_mask", "pixel_values"))
  assert first["inputs"].shape == other["inputs"].shape == (4, 511)
  assert first["pixel_values"].shape == other["pixel_values"].shape
  for batch in [first, other] + rows.held_out():   # 4 patches a placeholder (2x2 merge); padding patches are 0
    placeholders = int((batch["inputs"] == cfg.image_token_id).sum())
    pixels = batch["pixel_values"].reshape(batch["pixel_values"].shape[0], -1)
    assert placeholders > 0 and placeholders * 4 == int((np.abs(pixels).sum(1) > 0).sum())
  held = rows.held_out()
  assert len(held) == 1
  learned = sum(float(c.loss_mask[1:].sum()) for c in chats[10:12] + chats[32:])
  assert sum(float(b["loss_mask"].sum()) for b in held) == learned


def test_too_few_rows_for_the_batch_is_one_line(tmp_path):
  from configs import sft as sft_config
  from k25jax.train import chat_rows, config_utils
  cfg = config_utils.k25_config_from(sft_config.get_config("tiny,files").model, TOK)
  chats = _chats(tmp_path, n_text=2, n_image=2)
  with pytest.raises(files.BadData, match=r"the chats with images pack into 1 rows .* fewer than train.visual_batch=8"):
    chat_rows.ChatRows(chats, [], length=512, batch=1, visual_batch=8, pad_id=0, cfg=cfg, seed=0)


# ------------------------------------------------------------------------------- the stage
def test_main_exits_2_in_one_line_naming_a_bad_record(tmp_path):
  """`python -m k25jax.main --config=configs/sft.py:tiny,files` on a file with a bad record: exit
  2, one line naming the file and line. (The stage end to end on good files, the held-out loss
  falling by half, runs in tests/test_hf_k25_round_trip.py, from a Kimi K2.5 folder.)"""
  bad = _write_jsonl(tmp_path / "bad.jsonl", [GOOD, {"messages": [{"role": "bot", "content": "x"}]}])
  out = subprocess.run([sys.executable, "-m", "k25jax.main", "--config=configs/sft.py:tiny,files",
                        f"--config.data.files={bad}", f"--workdir={tmp_path / 'bad_run'}"], cwd=CHECKOUT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1].startswith(f"error: {bad}:2: messages[0] has role 'bot'")
  assert "Traceback" not in out.stderr


def test_the_config_check_names_what_does_not_go_with_the_source():
  from configs import sft as sft_config
  from k25jax.stages import sft
  config = sft_config.get_config("tiny,files")
  with pytest.raises(ValueError, match="data.source='files' needs data.files"):
    sft.check(config)
  config.data.files, config.data.text_replay = "x.jsonl", 10
  with pytest.raises(ValueError, match="data.text_replay=10 belongs to data.source='zero_vision'"):
    sft.check(config)
  config.data.text_replay, config.data.tokenizer = 0, "auto"
  with pytest.raises(ValueError, match="needs data.vocab_file or init.hf_checkpoint"):
    sft.check(config)
  plain = sft_config.get_config("tiny")
  plain.data.files = "x.jsonl"
  with pytest.raises(ValueError, match="data.files is read with data.source='files'"):
    sft.check(plain)
  plain.data.files, plain.data.source = "", "web"
  with pytest.raises(ValueError, match="data.source='web': must be one of"):
    sft.check(plain)
