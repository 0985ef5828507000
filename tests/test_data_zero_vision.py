"""Zero-vision SFT data: tool outputs from the real sandbox, answers = ground truth, mask on the assistant only."""
import numpy as np
import pytest

from k25jax.agents import sandbox
from k25jax.data import legacy_chat as chat, image_tasks, tool_formats, zero_vision


@pytest.fixture(scope="module")
def pool():
  with sandbox.SandboxPool(4) as p:
    yield p


@pytest.fixture(scope="module")
def generated(pool):
  tasks = image_tasks.make_tasks(12, seed=5)
  return tasks, zero_vision.conversations(tasks, pool, p_two_calls=0.5, seed=5)


def test_every_tool_call_runs_and_the_answer_is_the_ground_truth(generated, pool):
  tasks, steps = generated
  two_calls = 0
  for task, calls in zip(tasks, steps):
    two_calls += len(calls) == 2
    assert image_tasks.grade(calls[-1][1], task.answer)                # the last tool output states it
    assert task.image_name in calls[0][0]
    # Rerun the trajectory's calls in a fresh session of their own: same outputs.
    with pool.session(images=task.images) as session:
      for code, output in calls:
        result = session.run(code)
        assert result.ok, result.error
        assert result.stdout.rstrip("\n") == output
  assert 0 < two_calls < len(tasks)


def test_legacy_loss_mask_is_one_exactly_on_assistant_tokens(generated):
  tasks, steps = generated
  fmt = tool_formats.LegacyToolFormat()
  tok = fmt.tokenizer
  data = zero_vision.encode([fmt.trajectory(t.question, s, t.answer) for t, s in zip(tasks, steps)], 320, fmt.pad_id)
  for row, (task, calls) in enumerate(zip(tasks, steps)):
    conv = [chat.Message("user", task.question)]
    for code, output in calls:
      conv += [chat.Message("assistant", code, call=True), chat.Message("tool", output)]
    conv.append(chat.Message("assistant", task.answer))
    n = data["length"][row]
    tokens, mask = data["tokens"][row], data["loss_mask"][row]
    assert not mask[n:].any() and not tokens[n:].any()
    # Walk the messages: each assistant body (with <|call|> and <|end|>) is learned, nothing else.
    at = 1
    for message in conv:
      body = len(tok.encode(message.content)) + (1 if message.call else 0) + 1
      assert mask[at] == 0                                            # the role token
      assert np.all(mask[at + 1:at + 1 + body] == (message.role == "assistant"))
      at += 1 + body
    assert at == n
    learned = tok.decode(tokens[:n][mask[:n] == 1])
    assert learned.endswith(task.answer + "<|end|>") and "<|tool|>" not in learned
    assert task.question not in learned


def test_k25_trajectory_is_the_declared_python_tool_called_byte_for_byte():
  """Kimi K2.5's format: the tool declared, an empty system turn, each step a call of
  `python` with its code as the JSON argument and its result under the call's id; the mask is
  1 on the calls, the answer and each closing <|im_end|>."""
  fmt = tool_formats.K25ToolFormat()
  ids, mask = fmt.trajectory("How many red objects are in img_2?",
                             [('m = colour_mask(img_2, "red")', ""), ("print(connected_components(m)[1])", "3")], "3")
  expected = (
      "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
      "type python = (_: {\n  code: string\n}) => any;\n}\n<|im_end|>"
      "<|im_system|>system<|im_middle|><|im_end|>"
      "<|im_user|>user<|im_middle|>How many red objects are in img_2?<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|><|tool_call_begin|>"
      'functions.python:0<|tool_call_argument_begin|>{"code": "m = colour_mask(img_2, \\"red\\")"}'
      "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
      "<|im_system|>tool<|im_middle|>## Return of functions.python:0\n<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|><|tool_call_begin|>"
      'functions.python:1<|tool_call_argument_begin|>{"code": "print(connected_components(m)[1])"}'
      "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
      "<|im_system|>tool<|im_middle|>## Return of functions.python:1\n3<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|><think></think>3<|im_end|>")
  assert fmt.tokenizer.decode(ids) == expected
  learned = fmt.tokenizer.decode([i for i, m in zip(ids, mask) if m])
  assert learned == ('<|tool_calls_section_begin|><|tool_call_begin|>functions.python:0<|tool_call_argument_begin|>'
                     '{"code": "m = colour_mask(img_2, \\"red\\")"}<|tool_call_end|><|tool_calls_section_end|>'
                     '<|im_end|><|tool_calls_section_begin|><|tool_call_begin|>functions.python:1'
                     '<|tool_call_argument_begin|>{"code": "print(connected_components(m)[1])"}<|tool_call_end|>'
                     '<|tool_calls_section_end|><|im_end|>3<|im_end|>')
  prompt = fmt.prompt("How many red objects are in img_2?")
  assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])


def test_shards_never_put_two_images_of_one_name_together():
  tasks = image_tasks.make_tasks(40, seed=1)
  groups = zero_vision.shards(tasks)
  assert sorted(i for g in groups for i in g) == list(range(40))
  for g in groups:
    assert len({tasks[i].image_name for i in g}) == len(g)


def test_too_long_conversations_are_refused(generated):
  fmt = tool_formats.LegacyToolFormat()
  rendered = [fmt.trajectory(t.question, s, t.answer) for t, s in zip(*generated)]
  with pytest.raises(ValueError, match="data.max_length"):
    zero_vision.encode(rendered, 40, fmt.pad_id)
