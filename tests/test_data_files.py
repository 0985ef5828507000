"""data.source=files: JSONL, gzip JSONL and Parquet read into documents (Parquet written by
pyarrow, the library that owns the format), a token-weighted mixture of two sources, and every
bad input as one line naming the file. The end-to-end pre-training runs of test_train_e2e.py
read their text from files (a gzip JSONL and a Parquet file, 3:1): loss falls, resume and
SIGTERM are bit-exact there."""
import gzip
import json
import os
import pathlib
import subprocess
import sys

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cpu_env import subprocess_env
from test_train_step import micro_config

from k25jax.data import files, prepare, shards, sources, tokenizer
from k25jax.stages import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = tokenizer.ByteTokenizer()


def _jsonl(path, records, gz=False) -> str:
  lines = "".join(json.dumps(r) + "\n" for r in records)
  if gz:
    with gzip.open(path, "wt", encoding="utf-8") as f:
      f.write(lines)
  else:
    path.write_text(lines, encoding="utf-8")
  return str(path)


def _parquet(path, columns: dict) -> str:
  pq.write_table(pa.table(columns), str(path))
  return str(path)


def _data(spec: str, **kw) -> ml_collections.ConfigDict:
  fields = dict(source="files", files=spec, eval_files="", text_field="text", eval_every=4, max_doc_chars=1000)
  return ml_collections.ConfigDict({**fields, **kw})


def test_each_format_reads_its_records_in_order_and_every_fourth_is_held_out(tmp_path):
  docs = [f"document {i}: {'é' * i}" for i in range(8)]
  _jsonl(tmp_path / "a.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
  _jsonl(tmp_path / "b.jsonl.gz", [{"text": d.upper()} for d in docs], gz=True)
  _parquet(tmp_path / "c.parquet", {"body": docs, "n": list(range(8))})
  assert files.read(str(tmp_path / "a.jsonl"), "text") == docs
  assert files.read(str(tmp_path / "b.jsonl.gz"), "text") == [d.upper() for d in docs]
  assert files.read(str(tmp_path / "c.parquet"), "body") == docs
  mixed, held_out = files.load(_data(f"{tmp_path}/*.jsonl*:3"))
  both = docs + [d.upper() for d in docs]             # a.jsonl, then b.jsonl.gz: the glob's files sorted
  assert held_out == both[::4] and mixed == [(1.0, [d for k, d in enumerate(both) if k % 4])]
  mixed, held_out = files.load(_data(f"{tmp_path}/a.jsonl:3,{tmp_path}/b.jsonl.gz", eval_files=f"{tmp_path}/*.gz"))
  assert [w for w, _ in mixed] == [0.75, 0.25] and mixed[0][1] == docs and held_out == [d.upper() for d in docs]


def test_spec_parses_globs_and_token_shares():
  assert files.parse("a/*.jsonl:3, b.parquet") == [("a/*.jsonl", 3.0), ("b.parquet", 1.0)]
  assert files.parse("/data/x-*.jsonl.gz") == [("/data/x-*.jsonl.gz", 1.0)]
  for spec, message in [("", "give one or more GLOB"), ("a.jsonl:heavy", "the weight 'heavy' is not a number"),
                        ("a.jsonl:0", "a finite number > 0"), ("a.jsonl:nan", "a finite number > 0")]:
    with pytest.raises(files.BadData, match=message):
      files.parse(spec)
  with pytest.raises(files.BadData, match="these files take no weight"):
    files.parse("a.jsonl:2", "data.eval_files", weights=False)
  with pytest.raises(ValueError, match="data.source='books': must be one of"):
    sources.check(ml_collections.ConfigDict(dict(source="books")))


def test_every_bad_input_is_one_line_naming_the_file(tmp_path):
  good = _jsonl(tmp_path / "good.jsonl", [{"text": "fine"}] * 4)
  bad_json = tmp_path / "bad.jsonl"
  bad_json.write_text('{"text": "fine"}\n{"text": "cut\n')
  truncated = tmp_path / "cut.jsonl.gz"
  _jsonl(truncated, [{"text": "x" * 5000}] * 20, gz=True)
  truncated.write_bytes(truncated.read_bytes()[:200])
  cases = [
      (f"{tmp_path}/none-*.jsonl", "matches no file"),
      (str(tmp_path / "missing.jsonl"), "matches no file"),
      (str(bad_json), f"{bad_json}:2: not JSON"),
      (_jsonl(tmp_path / "field.jsonl", [{"text": "a"}, {"body": "b"}]), "field.jsonl:2: no 'text' field"),
      (_jsonl(tmp_path / "type.jsonl", [{"text": 3}]), "type.jsonl:1: 'text' is int, not text"),
      (_jsonl(tmp_path / "list.jsonl", [["text"]]), "list.jsonl:1: not a JSON object"),
      (str(truncated), "cut.jsonl.gz: unreadable"),
      (_parquet(tmp_path / "column.parquet", {"body": ["a"]}), "column.parquet: no 'text' column"),
      (_parquet(tmp_path / "null.parquet", {"text": ["a", None]}), "null.parquet:row 1: 'text' is NoneType"),
      (_jsonl(tmp_path / "empty.jsonl", []), "holds no document"),
  ]
  (tmp_path / "notes.md").write_text("text")
  cases.append((str(tmp_path / "notes.md"), "notes.md: unknown format"))
  for spec, message in cases:
    with pytest.raises(files.BadData) as error:
      files.load(_data(spec))
    assert message in str(error.value) and "\n" not in str(error.value), (spec, str(error.value))
  with pytest.raises(files.BadData, match="takes one text source"):
    files.single_source(_data(f"{good}:3,{good}"))


def test_on_bad_record_skip_keeps_the_good_records_and_reports_the_bad_once(tmp_path, caplog):
  mixed = tmp_path / "mixed.jsonl"
  mixed.write_text('{"text": "one"}\n{"text": 2}\nnot json\n{"text": "four"}\n{"body": "five"}\n{"text": "six"}\n')
  nulls = _parquet(tmp_path / "nulls.parquet", {"text": ["seven", None, "nine"]})
  with caplog.at_level("WARNING"):
    sources, held_out = files.load(_data(f"{mixed},{nulls}", on_bad_record="skip", eval_every=100))
  assert sources == [(0.5, ["four", "six"]), (0.5, ["nine"])] and held_out == ["one", "seven"]
  warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
  assert len(warnings) == 1 and warnings[0].startswith("data.files: skipped 4 bad record(s)")
  assert f"{mixed}:2: 'text' is int" in warnings[0] and f"{mixed}:3: not JSON" in warnings[0]
  with pytest.raises(files.BadData, match="mixed.jsonl:2: 'text' is int"):
    files.load(_data(str(mixed)))                                    # on_bad_record=error, the default
  truncated = tmp_path / "cut.jsonl.gz"
  _jsonl(truncated, [{"text": "x" * 5000}] * 20, gz=True)
  truncated.write_bytes(truncated.read_bytes()[:200])
  with pytest.raises(files.BadData, match="cut.jsonl.gz: unreadable"):     # a file, not a record: never skipped
    files.load(_data(str(truncated), on_bad_record="skip"))
  with pytest.raises(files.BadData, match="data.on_bad_record='drop': must be one of"):
    files.load(_data(str(mixed), on_bad_record="drop"))
  out = _prepared(tmp_path, "skipping", str(mixed), on_bad_record="skip")
  assert shards.read_manifest(out)["documents"] == 3 and shards.read_manifest(out)["skipped_records"] == 3


def _two_sources(tmp_path) -> tuple[str, str]:
  """Source A: short documents of the letters a-m; source B: documents 8x as long of n-z (so a
  mixture by documents would give B 8x A's tokens for equal weights)."""
  rng = np.random.default_rng(0)
  text = lambda letters, n: "".join(rng.choice(list(letters), n))
  a = _jsonl(tmp_path / "a.jsonl", [{"text": text("abcdefghijklm", int(rng.integers(10, 30)))} for _ in range(200)])
  b = _parquet(tmp_path / "b.parquet",
               {"text": [text("nopqrstuvwxyz", int(rng.integers(80, 240))) for _ in range(200)]})
  return a, b


@pytest.mark.slow
def test_the_mixture_draws_each_sources_tokens_in_its_weight(tmp_path):
  a, b = _two_sources(tmp_path)
  mixed, _ = files.load(_data(f"{a}:3,{b}:1"))
  batches = iter(files.mixture(mixed, TOK, seq_len=64, batch=8, seed=0, max_doc_tokens=1000))
  targets = np.concatenate([next(batches)["targets"].ravel() for _ in range(300)])
  from_a = np.isin(targets, [TOK.encode(c)[0] for c in "abcdefghijklm"]).sum()
  from_b = np.isin(targets, [TOK.encode(c)[0] for c in "nopqrstuvwxyz"]).sum()
  assert abs(from_a / (from_a + from_b) - 0.75) < 0.02, from_a / (from_a + from_b)


def test_main_stops_on_a_bad_record_in_one_line_with_status_2(tmp_path):
  bad = _jsonl(tmp_path / "corpus.jsonl", [{"text": "fine"}] * 9 + [{"title": "no text"}])
  result = subprocess.run([sys.executable, "-m", "k25jax.main", "--config=configs/pretrain.py", f"--workdir={tmp_path}",
                           "--config.data.source=files", f"--config.data.files={bad}"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-2000:]
  last_line = result.stderr.strip().splitlines()[-1]
  assert last_line == f"error: {bad}:10: no 'text' field (data.text_field); it has ['title']"


# ------------------------------------------------------------------------------ token shards
def _prepared(tmp_path, name, inputs, **kw):
  out = str(tmp_path / name)
  prepare.prepare(inputs, out, progress=False, **kw)
  return out


def _shard_bytes(folder) -> dict[str, bytes]:
  return {name: (pathlib.Path(folder) / name).read_bytes() for name in sorted(os.listdir(folder))
          if name.endswith(".array_record")}


def test_prepare_writes_the_documents_ids_and_a_resumed_prepare_writes_the_same_bytes(tmp_path, monkeypatch):
  a, b = _two_sources(tmp_path)
  inputs = f"{a},{b}"
  whole = _prepared(tmp_path, "whole", inputs, docs_per_shard=64)
  manifest = shards.read_manifest(whole)
  texts = files.read(a, "text") + files.read(b, "text")
  assert manifest["documents"] == len(texts) == 400 and len(manifest["shards"]) == 7
  assert manifest["tokens"] == sum(len(TOK.encode(t)) for t in texts)
  _, docs = shards.open_folder(whole, TOK)
  assert [list(docs[k]) for k in (0, 63, 64, 399)] == [TOK.encode(texts[k]) for k in (0, 63, 64, 399)]

  write, calls = shards.write_shard, []

  def interrupted(*args):
    calls.append(1)
    if len(calls) == 4:
      raise KeyboardInterrupt
    return write(*args)

  monkeypatch.setattr(shards, "write_shard", interrupted)
  with pytest.raises(KeyboardInterrupt):
    _prepared(tmp_path, "resumed", inputs, docs_per_shard=64)
  monkeypatch.undo()
  assert len(_shard_bytes(tmp_path / "resumed")) == 3 and not shards.is_prepared(str(tmp_path / "resumed"))
  resumed = _prepared(tmp_path, "resumed", inputs, docs_per_shard=64)
  assert _shard_bytes(resumed) == _shard_bytes(whole) and shards.read_manifest(resumed) == manifest
  stamp = os.path.getmtime(os.path.join(resumed, shards.MANIFEST))
  assert prepare.prepare(inputs, resumed, docs_per_shard=64, progress=False) == manifest      # finished: nothing to do
  assert os.path.getmtime(os.path.join(resumed, shards.MANIFEST)) == stamp
  assert _shard_bytes(_prepared(tmp_path, "two_workers", inputs, docs_per_shard=64, workers=2)) == _shard_bytes(whole)
  with pytest.raises(files.BadData, match="an interrupted prepare of other inputs"):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / prepare.PLAN).write_text("{}")
    prepare.prepare(a, str(tmp_path / "other"), progress=False)
  with pytest.raises(files.BadData, match="holds shards of other inputs"):
    prepare.prepare(a, resumed, docs_per_shard=64, progress=False)


class _OtherTokenizer(tokenizer.ByteTokenizer):
  offset = 4


def test_runs_read_prepared_shards_in_their_token_share_and_refuse_another_tokenizer(tmp_path):
  a, b = _two_sources(tmp_path)
  folder = _prepared(tmp_path, "a_shards", a, docs_per_shard=50)
  mixed, held_out = files.load(_data(f"{folder}:3,{b}:1"), TOK)
  assert len(mixed[0][1]) == 150 and len(held_out) == 100      # every 4th of each source's 200 held out
  assert [list(mixed[0][1][k]) for k in (0, 2, 3)] == [TOK.encode(files.read(a, "text")[k]) for k in (1, 3, 5)]
  batches = iter(files.mixture(mixed, TOK, seq_len=64, batch=8, seed=0, max_doc_tokens=1000))
  targets = np.concatenate([next(batches)["targets"].ravel() for _ in range(300)])
  from_a = np.isin(targets, [TOK.encode(c)[0] for c in "abcdefghijklm"]).sum()
  from_b = np.isin(targets, [TOK.encode(c)[0] for c in "nopqrstuvwxyz"]).sum()
  assert abs(from_a / (from_a + from_b) - 0.75) < 0.02, from_a / (from_a + from_b)
  # the stage's iterator over them resumes from its saved state (what a checkpoint holds)
  config = micro_config()
  config.data.update(source="files", files=f"{folder}:3,{b}:1", eval_every=4)
  config.train.update(seq_len=64, eval_batches=1)
  train, evals = pretrain.datasets(config, TOK)
  assert evals[0]["inputs"].shape == next(train)["inputs"].shape == (8, 64)
  state = train.get_state()
  ahead = [next(train)["inputs"] for _ in range(3)]
  again, _ = pretrain.datasets(config, TOK)
  again.set_state(state)
  np.testing.assert_array_equal([next(again)["inputs"] for _ in range(3)], ahead)
  with pytest.raises(files.BadData, match="tokenized by another tokenizer"):
    files.load(_data(folder), _OtherTokenizer())
  with pytest.raises(files.BadData, match="holds token shards, which feed text pre-training"):
    files.single_source(_data(folder))


def test_prepare_command_fails_in_one_line(tmp_path, capsys):
  assert prepare.main([f"--input={tmp_path}/none*.jsonl", f"--out={tmp_path}/out"]) == 2
  assert capsys.readouterr().err == f"error: --input: '{tmp_path}/none*.jsonl' matches no file\n"
