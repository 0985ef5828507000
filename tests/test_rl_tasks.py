"""k25jax.rl.tasks: the addition task's format, parser and grader; reasoning-gym tasks offline."""
import sys

import numpy as np
import pytest

from k25jax.data import image_tasks
from k25jax.rl import tasks

TOK = tasks.AdditionTokenizer()


def test_tokenizer_round_trip_and_vocab():
  assert TOK.vocab_size == 17
  text = "^57+68=75+86>521?75+86>521$__"
  assert TOK.decode(TOK.encode(text)) == text
  with pytest.raises(ValueError, match="'x'"):
    TOK.encode("12x")
  with pytest.raises(ValueError):
    TOK.decode([17])


def test_prompt_and_completion_formats_by_hand():
  assert TOK.decode(tasks.addition_prompt(57, 8)) == "^57+08="
  variants = {(False, False): "521$", (True, False): "75+86>521$",
              (False, True): "521?75+86>521$", (True, True): "75+86>521?75+86>521$"}
  for (scratch, check), text in variants.items():
    assert TOK.decode(tasks.addition_completion(57, 68, scratch=scratch, check=check)) == text
  assert TOK.decode(tasks.addition_completion(3, 4, scratch=False, check=False)) == "700$"


def test_prompt_rejects_operands_outside_two_digits():
  with pytest.raises(ValueError):
    tasks.addition_prompt(100, 1)


@pytest.mark.parametrize("scratch", [False, True])
@pytest.mark.parametrize("check", [False, True])
def test_parser_round_trips_every_variant(scratch, check):
  for a, b in [(0, 0), (99, 99), (57, 68), (5, 40), (10, 90)]:
    completion = tasks.addition_completion(a, b, scratch=scratch, check=check)
    assert tasks.parse_addition(completion) == a + b


def test_demonstrations_cover_all_lengths_and_parse():
  d = tasks.addition_demonstrations(64, seed=3)
  assert set(d["completion_length"].tolist()) == {4, 10, 14, 20}
  assert d["tokens"].shape == (64, 27)              # 7 prompt tokens + 20, the longest completion
  np.testing.assert_array_equal(d["completion_mask"].sum(1), d["completion_length"])
  np.testing.assert_array_equal(d["length"], d["completion_length"] + 7)
  completions = d["tokens"][:, 7:]
  graded = tasks.grade_addition(completions, d["a"], d["b"])
  assert graded["reward"].sum() == 64 and graded["num_unparsable"] == 0
  np.testing.assert_array_equal(graded["length"], d["completion_length"])
  expected = 4 + 6 * d["scratch"] + 10 * d["check"]
  np.testing.assert_array_equal(d["completion_length"], expected)


def test_demonstrations_respect_block_probabilities():
  bare = tasks.addition_demonstrations(16, seed=0, p_scratch=0.0, p_check=0.0)
  assert np.all(bare["completion_length"] == 4)
  full = tasks.addition_demonstrations(16, seed=0, p_scratch=1.0, p_check=1.0)
  assert np.all(full["completion_length"] == 20)
  with pytest.raises(ValueError):
    tasks.addition_demonstrations(4, seed=0, p_scratch=1.5)


def test_determinism_given_seed():
  a, b = tasks.addition_prompts(32, seed=7), tasks.addition_prompts(32, seed=7)
  np.testing.assert_array_equal(a["tokens"], b["tokens"])
  assert not np.array_equal(a["tokens"], tasks.addition_prompts(32, seed=8)["tokens"])
  d1, d2 = tasks.addition_demonstrations(32, seed=7), tasks.addition_demonstrations(32, seed=7)
  np.testing.assert_array_equal(d1["tokens"], d2["tokens"])
  np.testing.assert_array_equal(a["tokens"], d1["tokens"][:, :7])
  assert a["tokens"].shape == (32, 7) and np.all(a["prompt_length"] == 7)
  assert a["a"].min() >= 0 and a["a"].max() <= 99


def test_grader_scores_wrong_and_unparsable_as_zero_and_counts_them():
  rows = [
      "521$",            # correct
      "75+86>521$__",    # correct with scratch
      "421$",            # wrong but well formed: 0, not unparsable
      "521",             # truncated (no EOS): unparsable
      "52$",             # two digits: unparsable
      "521?75+8>521$",   # malformed check block: unparsable
      "+=$",             # garbage
      "521$?99",         # junk after EOS is ignored: correct
  ]
  width = max(len(r) for r in rows)
  completions = np.array([TOK.encode(r.ljust(width, "_")) for r in rows])
  n = len(rows)
  out = tasks.grade_addition(completions, np.full(n, 57), np.full(n, 68))
  np.testing.assert_array_equal(out["reward"], [1, 1, 0, 0, 0, 0, 0, 1])
  np.testing.assert_array_equal(out["unparsable"], [0, 0, 0, 1, 1, 1, 1, 0])
  assert out["num_unparsable"] == 4
  np.testing.assert_array_equal(out["length"], [4, 10, 4, width, 3, 13, 3, 4])


CHAT = tasks.ChatRendering()


def test_chat_rendering_by_hand():
  tok = CHAT.tokenizer
  assert tok.vocab_size == 268                     # the K2.5 chat model's vocabulary (configs/common.py)
  assert tok.decode(tasks.addition_prompt(57, 8, CHAT)) == "<|user|>57+08=<|end|><|assistant|>"
  assert tasks.addition_prompt(57, 8, CHAT)[0] == tok.bos_id
  completion = tasks.addition_completion(57, 68, scratch=True, check=False, render=CHAT)
  assert tok.decode(completion) == "75+86>521<|end|>" and completion[-1] == tok.end_id


@pytest.mark.parametrize("scratch", [False, True])
@pytest.mark.parametrize("check", [False, True])
def test_renderings_carry_the_same_text(scratch, check):
  """Both renderings write the same characters, one token each, and parse back to the sum."""
  for a, b in [(0, 0), (99, 99), (57, 68), (5, 40)]:
    text = tasks.addition_answer_text(a, b, scratch=scratch, check=check)
    compact = tasks.addition_completion(a, b, scratch=scratch, check=check)
    chat_ids = tasks.addition_completion(a, b, scratch=scratch, check=check, render=CHAT)
    assert TOK.decode(compact[:-1]) == CHAT.tokenizer.decode(chat_ids[:-1]) == text
    assert len(compact) == len(chat_ids)
    assert tasks.parse_addition(compact) == tasks.parse_addition(chat_ids, CHAT) == a + b


def test_chat_demonstrations_and_prompts_match_the_compact_ones():
  chat_d, compact_d = tasks.addition_demonstrations(32, seed=4, render=CHAT), tasks.addition_demonstrations(32, seed=4)
  for key in ("a", "b", "scratch", "check", "completion_length"):
    np.testing.assert_array_equal(chat_d[key], compact_d[key])
  assert chat_d["tokens"].shape == (32, 10 + 20)                # BOS, <|user|>, 6 characters, <|end|>, <|assistant|>
  np.testing.assert_array_equal(chat_d["length"], chat_d["completion_length"] + 10)
  graded = tasks.grade_addition(chat_d["tokens"][:, 10:], chat_d["a"], chat_d["b"], CHAT)
  assert graded["reward"].sum() == 32 and graded["num_unparsable"] == 0
  np.testing.assert_array_equal(graded["length"], chat_d["completion_length"])


def test_chat_grader_treats_calls_role_tokens_and_truncation_as_unparsable():
  tok = CHAT.tokenizer
  rows = [tok.encode("521") + [tok.end_id],                        # correct
          tok.encode("421") + [tok.end_id],                        # wrong, well formed
          [tok.call_id] + tok.encode("521") + [tok.end_id],        # a tool call, not an answer
          tok.encode("52") + [tok.user_id] + tok.encode("1") + [tok.end_id],   # a role token inside
          tok.encode("521"),                                      # truncated: no <|end|>
          tok.encode(" 521") + [tok.end_id],                       # a space is outside the grammar
          tok.encode("521") + [tok.end_id] + tok.encode("zz")]     # after <|end|>: ignored
  width = max(len(r) for r in rows)
  completions = np.array([r + [tok.pad_id] * (width - len(r)) for r in rows])
  out = tasks.grade_addition(completions, np.full(len(rows), 57), np.full(len(rows), 68), CHAT)
  np.testing.assert_array_equal(out["reward"], [1, 0, 0, 0, 0, 0, 1])
  np.testing.assert_array_equal(out["unparsable"], [0, 0, 1, 1, 1, 1, 0])
  np.testing.assert_array_equal(out["length"], [4, 4, 5, 5, width, 5, 4])


K25 = tasks.K25Rendering()


def test_k25_rendering_by_hand_and_the_run_config_speaks_it():
  from configs import rl as rl_config
  from k25jax.data import chat_formats
  from k25jax.stages import rl
  tok = K25.tokenizer
  assert tok.vocab_size == 275
  assert tok.decode(tasks.addition_prompt(57, 8, K25)) == (
      "<|im_system|>system<|im_middle|><|im_end|><|im_user|>user<|im_middle|>57+08=<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|><think></think>")
  completion = tasks.addition_completion(57, 68, scratch=True, check=False, render=K25)
  assert tok.decode(completion) == "75+86>521<|im_end|>" and completion[-1] == tok.special["<|im_end|>"]
  demos = tasks.addition_demonstrations(32, seed=4, render=K25)
  assert demos["tokens"].shape == (32, 35 + 20)
  graded = tasks.grade_addition(demos["tokens"][:, 35:], demos["a"], demos["b"], K25)
  assert graded["reward"].sum() == 32 and graded["num_unparsable"] == 0
  config = rl_config.get_config("tiny,k25_format")
  rl.check(config)
  assert config.model.vocab_size == tok.vocab_size and chat_formats.record_of(tok) == chat_formats.K25_RECORD


def test_k25_grader_treats_calls_stray_tokens_and_truncation_as_unparsable():
  tok, end = K25.tokenizer, K25.tokenizer.special["<|im_end|>"]
  call = [tok.special[n] for n in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")] + tok.encode(
      "functions.python:0") + [tok.special["<|tool_call_argument_begin|>"]] + tok.encode('{"code": "1"}') + [
      tok.special[n] for n in ("<|tool_call_end|>", "<|tool_calls_section_end|>")]
  rows = [tok.encode("521") + [end], tok.encode("421") + [end], call + [end],
          tok.encode("52") + [tok.special["<|im_user|>"]] + tok.encode("1") + [end], tok.encode("521"), [end],
          tok.encode("521") + [end] + tok.encode("zz")]
  width = max(len(r) for r in rows)
  completions = np.array([r + [tasks.PAD_ID] * (width - len(r)) for r in rows])
  out = tasks.grade_addition(completions, np.full(len(rows), 57), np.full(len(rows), 68), K25)
  np.testing.assert_array_equal(out["reward"], [1, 0, 0, 0, 0, 0, 1])
  np.testing.assert_array_equal(out["unparsable"], [0, 0, 1, 1, 1, 1, 0])


def test_arithmetic_chat_task_grades_every_correct_form_and_has_no_image():
  task, = tasks.arithmetic_tasks(1, seed=0)
  prompts = tasks.addition_prompts(1, seed=0)
  assert (task.a, task.b) == (prompts["a"][0], prompts["b"][0]) and task.images == {}
  assert task.question == tasks.addition_question(task.a, task.b)
  for scratch in (False, True):
    for check in (False, True):
      assert task.grade(tasks.addition_answer_text(task.a, task.b, scratch=scratch, check=check))
  assert task.grade(task.answer) and not task.grade(None) and not task.grade("999")
  assert task.reward(task.answer) == 1.0 and task.reward("999") == 0.0
  assert task.kind in tasks.ABILITIES


def test_every_task_kind_has_an_ability():
  # file: rl_vision records of prompt files; describe: the descriptions a GRM judges (data/descriptions.py)
  assert set(tasks.ABILITIES) == {"addition", *image_tasks.KINDS, "describe", "file"}


def test_unknown_rendering_is_refused():
  with pytest.raises(ValueError, match="task.rendering"):
    tasks.rendering("xml")


def test_grader_shape_mismatch_raises():
  with pytest.raises(ValueError):
    tasks.grade_addition(np.zeros((3, 5), int), np.zeros(2), np.zeros(3))


# --- reasoning-gym ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["countdown", "gsm_symbolic"])
def test_reasoning_gym_demonstrations_score_one(name):
  task = tasks.ReasoningGymTask(name, size=4, seed=0)
  demos = [task.demonstration(i) for i in range(4)]
  out = task.grade(range(4), demos)
  np.testing.assert_array_equal(out["reward"], [1, 1, 1, 1])
  assert "<answer></answer>" in task.prompt(0)


@pytest.mark.parametrize("name", ["countdown", "gsm_symbolic"])
def test_reasoning_gym_wrong_and_unparsable(name):
  task = tasks.ReasoningGymTask(name, size=2, seed=0)
  out = task.grade([0, 0, 1], ["<answer>1</answer>", "the answer is 7", "<answer></answer>"])
  np.testing.assert_array_equal(out["reward"], [0, 0, 0])
  np.testing.assert_array_equal(out["unparsable"], [0, 1, 0])
  assert out["num_unparsable"] == 1


def test_reasoning_gym_is_deterministic_given_seed():
  a = tasks.ReasoningGymTask("gsm_symbolic", size=3, seed=5)
  b = tasks.ReasoningGymTask("gsm_symbolic", size=3, seed=5)
  assert [a.prompt(i) for i in range(3)] == [b.prompt(i) for i in range(3)]
  c = tasks.ReasoningGymTask("countdown", size=3, seed=6)
  assert c.prompt(0) != tasks.ReasoningGymTask("countdown", size=3, seed=5).prompt(0)


def test_reasoning_gym_unknown_task_and_missing_package(monkeypatch):
  with pytest.raises(ValueError, match="available"):
    tasks.ReasoningGymTask("chess", size=1, seed=0)
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)
  with pytest.raises(ImportError, match="pip install reasoning-gym"):
    tasks.ReasoningGymTask("countdown", size=1, seed=0)
