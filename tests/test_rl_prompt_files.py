"""RL prompts from files (k25jax/rl/prompt_files.py) and their verifiers (k25jax/rl/verifiers.py):
every verifier on hand-written completions, JSONL / gzip JSONL / Parquet records, the held-out
split, the warm start's demonstrations, grading sampled ids, every bad input in one line naming
the file and line (or skipped and counted), and the RL stage on a prompt file end to end."""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from cpu_env import subprocess_env

from k25jax.data import files
from k25jax.rl import prompt_files, verifiers

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _task_section(**overrides):
  from configs import rl as rl_config
  task = rl_config.get_config().task
  task.update({"name": "file", "eval_prompts": 1, **overrides})
  return task


def _write_jsonl(path, records, opener=open):
  with opener(path, "wt", encoding="utf-8") as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


# ------------------------------------------------------------------------------- verifiers
@pytest.mark.parametrize("name, completion, record, reward", [
    ("exact", "  42\n", {"answer": "42"}, 1.0),
    ("exact", "42.", {"answer": "42"}, 0.0),
    ("exact", "7", {"answer": 7}, 1.0),
    ("numeric", "so the total is 1,234.5 apples", {"answer": "1234.5"}, 1.0),
    ("numeric", "first 3, then -8", {"answer": -8}, 1.0),
    ("numeric", "about 3.14", {"answer": 3.14159, "tolerance": 1e-3}, 1.0),
    ("numeric", "about 3.14", {"answer": 3.14159}, 0.0),
    ("numeric", "no number here", {"answer": 1}, 0.0),
    ("numeric", "2.5e3", {"answer": "2500"}, 1.0),
    ("math", "The answer is $\\frac{1}{2}$.", {"answer": "0.5"}, 1.0),
    ("math", "\\boxed{x + 1}", {"answer": "1+x"}, 1.0),
    ("math", "It is 41.", {"answer": "42"}, 0.0),
    ("math", "1/2", {"answer": "\\frac{1}{2}"}, 1.0),
])
def test_the_text_verifiers_score_hand_written_completions(name, completion, record, reward):
  assert verifiers.get(name)("a prompt", completion, record) == reward


def test_python_tests_scores_the_share_of_tests_that_pass_in_the_sandbox():
  tests = ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 1"]
  verify = verifiers.get("python_tests")
  assert verify("", "def square(x):\n  return x * x", {"tests": tests}) == pytest.approx(2 / 3)
  fenced = "Here it is:\n```python\ndef square(x):\n  return x ** 2\n```\nDone."
  assert verify("", fenced, {"tests": tests}) == pytest.approx(2 / 3)
  assert verify("", "def square(x) return x", {"tests": tests}) == 0.0            # does not run
  assert verify("", "while True:\n  pass", {"tests": tests}) == 0.0               # killed at the CPU limit
  assert verify("", "import socket\nsquare = lambda x: x * x", {"tests": tests}) == 0.0   # refused import
  assert verifiers.get(verifiers.PYTHON_TESTS) is verify                          # its module:function name


def test_a_users_verifier_is_imported_by_module_and_function(tmp_path, monkeypatch):
  (tmp_path / "my_rewards.py").write_text("def length_bonus(prompt, completion, record):\n"
                                          "  return len(completion) / record['target']\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  assert verifiers.get("my_rewards:length_bonus")("p", "abcd", {"target": 8}) == 0.5
  for spec, message in [("my_rewards:nothing", "has no function 'nothing'"), ("no_such_module:f", "cannot import"),
                        ("bogus", "name a built-in")]:
    with pytest.raises(ValueError, match=message):
      verifiers.get(spec)


@pytest.mark.parametrize("name, record, message", [
    ("exact", {}, "no 'answer' field"),
    ("math", {"answer": [1]}, "'answer' is list"),
    ("numeric", {"answer": "forty"}, "is not a number"),
    ("numeric", {"answer": "nan"}, "not a finite number"),
    ("numeric", {"answer": 1, "tolerance": -1}, "'tolerance' -1 must be a number >= 0"),
    ("python_tests", {"tests": []}, "non-empty list of Python statements"),
    ("python_tests", {}, "no 'tests' field")])
def test_records_that_a_verifier_cannot_read_are_named(name, record, message):
  assert message in verifiers.check_record(name, record)


# -------------------------------------------------------------------------------- reading
RECORDS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "verifier": "math"} for a, b in [(1, 2), (3, 4), (5, 6)]]


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet"])
def test_records_read_from_jsonl_gzip_and_parquet(tmp_path, fmt):
  path = tmp_path / f"prompts.{fmt}"
  if fmt == "parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(RECORDS + [{"prompt": "9+9=", "answer": "18", "image": None}]), path)
  else:
    _write_jsonl(path, RECORDS + [{"prompt": "9+9=", "answer": "18"}], gzip.open if fmt.endswith("gz") else open)
  records = prompt_files.read(str(path), "task.files", "exact", files.BadRecords(), {})
  assert [r.prompt for r in records] == ["1+2=", "3+4=", "5+6=", "9+9="]      # Parquet: a null column is absent
  assert [r.verifier for r in records] == ["math"] * 3 + ["exact"] and records[1].demonstration == "7"
  assert records[2].where == (f"{path}:row 2" if fmt == "parquet" else f"{path}:3")


def test_the_task_holds_out_prompts_renders_them_as_chat_turns_and_grades_with_each_records_verifier(tmp_path):
  from k25jax.data import legacy_chat
  records = [{"prompt": f"{n}*2=", "answer": str(2 * n)} for n in range(10)]
  records.append({"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"},
                               {"role": "user", "content": "Again"}], "answer": "hi", "verifier": "exact"})
  path = _write_jsonl(tmp_path / "p.jsonl", records)
  task = prompt_files.FileTask(_task_section(files=path, eval_prompts=3, verifier="numeric"), max_positions=64)
  assert len(task.train["tokens"]) == 8 and len(task.eval["tokens"]) == 3
  seen = {r.where for r in task.train["record"]} | {r.where for r in task.eval["record"]}
  assert len(seen) == 11
  tok = task.tokenizer
  first = task.train["record"][0]
  expected, _ = legacy_chat.render(tok, [legacy_chat.Message(m["role"], m["content"]) for m in first.messages])
  assert task.train["tokens"][0, :task.train["prompt_length"][0]].tolist() == expected + [tok.assistant_id]
  # completions: right, wrong, no stop token (unparsable), a tool call (unparsable)
  n = int(first.prompt.split("*")[0])
  rows = np.zeros(4, int)
  completions = [tok.encode(f"it is {2 * n}") + [tok.end_id], tok.encode("-1") + [tok.end_id],
                 tok.encode(str(2 * n)), [tok.call_id] + tok.encode("print(1)") + [tok.end_id]]
  width = max(len(c) for c in completions)
  padded = np.array([c + [tok.pad_id] * (width - len(c)) for c in completions])
  graded = task.grade(task.train, rows, padded)
  np.testing.assert_array_equal(graded["reward"], [1, 0, 0, 0])
  np.testing.assert_array_equal(graded["unparsable"], [False, False, True, True])
  assert graded["num_unparsable"] == 2 and graded["length"][0] == len(completions[0])
  assert task.max_new_tokens == 64 - max(task.train["tokens"].shape[1], task.eval["tokens"].shape[1])


def test_in_the_k25_format_prompts_open_with_a_system_turn_and_answers_close_with_im_end(tmp_path):
  from k25jax.data import chat
  records = [{"prompt": "2+2=", "answer": "4"},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3="}],
              "answer": "6"}]
  path = _write_jsonl(tmp_path / "p.jsonl", records)
  held = _write_jsonl(tmp_path / "h.jsonl", [{"prompt": "1+1=", "answer": "2"}])
  task = prompt_files.FileTask(_task_section(files=path, eval_files=held, rendering="k2.5"), max_positions=64)
  tok = task.tokenizer
  prompts = {tok.decode(row[:n]) for row, n in zip(task.train["tokens"], task.train["prompt_length"])}
  assert prompts == {chat.render_text([{"role": "system", "content": ""}, {"role": "user", "content": "2+2="}],
                                      add_generation_prompt=True),
                     chat.render_text(records[1]["messages"], add_generation_prompt=True)}
  end = tok.special[chat.IM_END]
  rows = np.array([tok.encode("4") + [end], tok.encode("44")])            # answered; truncated
  first = [i for i, r in enumerate(task.train["record"]) if r.prompt == "2+2="]
  graded = task.grade(task.train, np.array(first * 2), rows)
  np.testing.assert_array_equal(graded["reward"], [1, 0])
  np.testing.assert_array_equal(graded["unparsable"], [False, True])


def test_held_out_files_and_the_warm_starts_demonstrations(tmp_path):
  train = _write_jsonl(tmp_path / "train.jsonl", RECORDS + [{"prompt": "f?", "tests": ["assert f"],
                                                            "verifier": "python_tests"}])
  held = _write_jsonl(tmp_path / "held.jsonl", [{"prompt": "9+9=", "answer": "18"}])
  task = prompt_files.FileTask(_task_section(files=train, eval_files=held), max_positions=64)
  assert len(task.train["tokens"]) == 4 and [r.prompt for r in task.eval["record"]] == ["9+9="]
  tokens, mask, lengths = task.demonstrations(32, seed=0, p_scratch=0.5, p_check=0.5)
  tok = task.tokenizer
  for row, m, n in zip(tokens, mask, lengths):
    assert tok.decode(row[m > 0]) in {"3<|end|>", "7<|end|>", "11<|end|>"}   # python_tests has no demonstration
    assert m[n - 1] == 1 and not m[n:].any()
  untaught = _write_jsonl(tmp_path / "untaught.jsonl", [{"prompt": "f?", "tests": ["assert f"],
                                                         "verifier": "python_tests"}] * 3)
  with pytest.raises(ValueError, match="no training record has a demonstration"):
    prompt_files.FileTask(_task_section(files=untaught), max_positions=64).demonstrations(4, 0, 0.5, 0.5)


# --------------------------------------------------------------------------- bad inputs
GOOD = json.dumps({"prompt": "1+1=", "answer": "2"})


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"answer": "2"}), "give exactly one of 'prompt' (text) and 'messages'"),
    (json.dumps({"prompt": "", "answer": "2"}), "'prompt' must be non-empty text"),
    (json.dumps({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], "answer": "2"}),
     "messages[0] must be"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                 "answer": "2"}), "the last message must be the user's"),
    (json.dumps({"prompt": "x", "image": "cat.png", "answer": "2"}), "the rl_vision stage's"),
    (json.dumps({"prompt": "x"}), "no 'answer' field"),
    (json.dumps({"prompt": "x", "answer": "2", "verifier": "no_module_here:f"}), "cannot import no_module_here"),
])
def test_a_bad_record_is_one_line_naming_its_line_or_is_skipped_and_counted(tmp_path, line, message):
  path = tmp_path / "prompts.jsonl"
  path.write_text("\n".join([GOOD, GOOD, line, GOOD]) + "\n")
  with pytest.raises(files.BadData) as error:
    prompt_files.FileTask(_task_section(files=str(path)), max_positions=64)
  assert str(error.value).startswith(f"{path}:3: ") and message in str(error.value)
  assert "\n" not in str(error.value)
  task = prompt_files.FileTask(_task_section(files=str(path), on_bad_record="skip"), max_positions=64)
  assert len(task.train["tokens"]) + len(task.eval["tokens"]) == 3 and len(task.scorer.bad.messages) == 1


def test_bad_files_and_prompts_too_long_for_the_model_are_named(tmp_path):
  with pytest.raises(files.BadData, match="matches no file"):
    prompt_files.FileTask(_task_section(files=str(tmp_path / "none*.jsonl")), max_positions=64)
  broken = tmp_path / "broken.jsonl.gz"
  broken.write_bytes(b"not gzip")
  with pytest.raises(files.BadData, match=f"{broken}: unreadable"):
    prompt_files.FileTask(_task_section(files=str(broken)), max_positions=64)
  long = _write_jsonl(tmp_path / "long.jsonl", [GOOD, GOOD, json.dumps({"prompt": "x" * 80, "answer": "1"})])
  with pytest.raises(files.BadData, match=f"{long}:3: the prompt is 84 tokens"):
    prompt_files.FileTask(_task_section(files=long), max_positions=64)
  with pytest.raises(ValueError, match="task.rendering='compact'"):
    prompt_files.FileTask(_task_section(files=long, rendering="compact"), max_positions=64)


def test_a_verifier_that_raises_names_the_record_or_scores_zero_under_skip(tmp_path, monkeypatch):
  (tmp_path / "flaky.py").write_text("def verify(prompt, completion, record):\n"
                                     "  if completion == 'boom':\n    raise KeyError('x')\n"
                                     "  return float('nan') if completion == 'nan' else 1.0\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "verifier": "flaky:verify"}] * 3)
  task = prompt_files.FileTask(_task_section(files=path), max_positions=64)
  record = task.train["record"][0]
  assert task.scorer.score(record, "fine") == 1.0
  for completion, message in [("boom", "failed (KeyError: 'x')"), ("nan", "failed (ValueError: returned nan)")]:
    with pytest.raises(files.BadData, match=f"^{path}:\\d: verifier 'flaky:verify' {message}".replace("(", r"\(")
                       .replace(")", r"\)")):
      task.scorer.score(record, completion)
  lenient = prompt_files.FileTask(_task_section(files=path, on_bad_record="skip"), max_positions=64)
  assert lenient.scorer.score(record, "boom") == 0.0


# ------------------------------------------------------------------- the rl_vision stage's records
def write_image_records(folder, tasks) -> str:
  """Each task's image as a PNG beside a JSONL of {"prompt", "image", "answer", "verifier": "exact"}."""
  from PIL import Image
  records = []
  for i, task in enumerate(tasks):
    Image.fromarray(task.image).save(folder / f"image_{i}.png")
    records.append({"prompt": task.question, "image": f"image_{i}.png", "answer": task.answer, "verifier": "exact"})
  return _write_jsonl(folder / "vision.jsonl", records)


def _vision_config(**task):
  from configs import rl as rl_config
  config = rl_config.get_config("vision")
  config.task.update({"eval_prompts": 1, **task})
  return config


def _vision_section(**task):
  return _vision_config(**task).task


def test_image_records_become_rl_vision_tasks_with_their_pixels_and_verifiers(tmp_path):
  from k25jax.data import image_tasks
  from k25jax.stages import rl_vision
  made = image_tasks.make_tasks(4, seed=0, image_size=56, kinds=("count", "read"))
  path = write_image_records(tmp_path, made)
  with open(path, "a") as f:
    f.write(json.dumps({"prompt": "What is 2+2?", "answer": "4", "verifier": "numeric"}) + "\n")
  train, held_out = prompt_files.vision_tasks(_vision_section(files=path))
  by_question = {t.question: t for t in train + held_out}
  assert len(by_question) == 5
  for task in made:
    got = by_question[task.question]
    np.testing.assert_array_equal(got.images["img_1"], task.image)
    assert got.grade(task.answer) and not got.grade(task.answer + "0") and not got.grade(None)
  text_only = by_question["What is 2+2?"]
  assert text_only.images == {} and text_only.reward("about 4") == 1.0
  config = _vision_config(files=path)
  train_split, eval_split = rl_vision.TaskSplit.from_config(config)
  assert len(train_split.tasks) == 4 and len(eval_split.tasks) == 1
  assert sum(m is not None for m in train_split.items + eval_split.items) == 4
  assert max(m.pixel_values.shape[0] for m in train_split.items + eval_split.items if m is not None) <= 16


@pytest.mark.parametrize("line, message", [
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "answer": "1"}), "not 'messages'"),
    (json.dumps({"prompt": "x", "image": "missing.png", "answer": "1"}), "image 'missing.png' does not exist"),
    (json.dumps({"prompt": "x", "image": 3, "answer": "1"}), "'image' must be a path"),
])
def test_bad_image_records_are_named(tmp_path, line, message):
  path = tmp_path / "v.jsonl"
  path.write_text("\n".join([GOOD, GOOD, line]) + "\n")
  with pytest.raises(files.BadData) as error:
    prompt_files.vision_tasks(_vision_section(files=str(path)))
  assert str(error.value).startswith(f"{path}:3: ") and message in str(error.value)


def test_an_image_that_does_not_decode_is_named_when_drawn(tmp_path):
  (tmp_path / "broken.png").write_bytes(b"not a png")
  path = _write_jsonl(tmp_path / "v.jsonl", [json.loads(GOOD), {"prompt": "x", "image": "broken.png", "answer": "1"}])
  train, held_out = prompt_files.vision_tasks(_vision_section(files=path, eval_prompts=1))
  broken, = [t for t in train + held_out if t.record.image]
  with pytest.raises(files.BadData, match=f"^{path}:2: image file .* cannot decode"):
    broken.images


def test_a_shared_warm_start_follows_the_files_contents_not_only_their_names(tmp_path):
  from configs import rl as rl_config
  from k25jax.stages import rl
  path = _write_jsonl(tmp_path / "p.jsonl", RECORDS)
  config = rl_config.get_config()
  config.task.update(name="file", files=path, eval_prompts=1)
  key = rl.warm_start_key(config)
  assert rl.warm_start_key(config) == key
  _write_jsonl(tmp_path / "p.jsonl", RECORDS[::-1])
  assert rl.warm_start_key(config) != key


# ------------------------------------------------------------------------- the RL stage
def test_the_stage_checks_a_file_tasks_fields():
  from configs import rl as rl_config
  from k25jax.stages import rl
  config = rl_config.get_config()
  config.task.name = "file"
  with pytest.raises(ValueError, match="needs task.files"):
    rl.check(config)
  config.task.update(files="p.jsonl", verifier="not_a_verifier")
  with pytest.raises(ValueError, match="verifier 'not_a_verifier'"):
    rl.check(config)
  config.task.update(verifier="math", on_bad_record="ignore")
  with pytest.raises(ValueError, match="task.on_bad_record='ignore'"):
    rl.check(config)
  from k25jax.stages import rl_vision
  vision = _vision_config(files="v.jsonl", verifier="my_module_is_missing:f")
  with pytest.raises(ValueError, match="cannot import my_module_is_missing"):
    rl_vision.check(vision)


@pytest.mark.slow
def test_main_runs_rl_on_a_prompt_file_and_a_bad_record_exits_2_in_one_line(tmp_path):
  """`python -m k25jax.main --config=configs/rl.py:tiny,k25_format --config.task.name=file ...`
  (Kimi K2.5's chat format): a short warm start on the records' answers, two RL iterations
  graded by the math verifier, an evaluation on the held-out file; then a file with a bad
  record: exit 2, one line naming it."""
  rng = np.random.default_rng(0)
  pairs = rng.integers(0, 10, (80, 2))
  train = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b), "verifier": "math"}
                                                  for a, b in pairs[:64]])
  held = _write_jsonl(tmp_path / "held.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs[64:]])
  common = [sys.executable, "-m", "k25jax.main", "--config=configs/rl.py:tiny,k25_format", "--config.task.name=file",
            f"--config.task.eval_files={held}", "--config.task.verifier=math"]
  flags = ["--config.warm_start.steps=30", "--config.warm_start.demonstrations=256", "--config.warm_start.batch=32",
           "--config.train.steps=2", "--config.rl.prompts_per_iteration=4", "--config.train.eval_every=2",
           "--config.train.log_every=1", "--config.rl.max_new_tokens=8"]
  out = subprocess.run(common + [f"--config.task.files={train}", f"--workdir={tmp_path / 'run'}", *flags],
                       cwd=CHECKOUT, env=subprocess_env(compile_bound=True), capture_output=True, text=True,
                       timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  from tensorboard.backend.event_processing import event_accumulator
  events = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
  events.Reload()
  rewards = [(e.step, e.value) for e in events.Scalars("train/reward")]
  assert [step for step, _ in rewards] == [1, 2] and all(0 <= r <= 1 for _, r in rewards)
  assert 0 <= events.Scalars("eval/accuracy")[-1].value <= 1
  bad = _write_jsonl(tmp_path / "bad.jsonl", [GOOD, '{"prompt": "x", "verifier": "math"}'])
  out = subprocess.run(common + [f"--config.task.files={bad}", f"--workdir={tmp_path / 'bad_run'}", *flags],
                       cwd=CHECKOUT, env=subprocess_env(compile_bound=True), capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  assert f"{bad}:2: no 'answer' field (the math verifier reads it)" in out.stderr
