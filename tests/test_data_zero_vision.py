"""Zero-vision SFT data: tool outputs from the real sandbox, answers = ground truth, mask on the assistant only."""
import numpy as np
import pytest

from k25jax.agents import sandbox
from k25jax.data import legacy_chat as chat, image_tasks, zero_vision


@pytest.fixture(scope="module")
def pool():
  with sandbox.SandboxPool(4) as p:
    yield p


@pytest.fixture(scope="module")
def generated(pool):
  tasks = image_tasks.make_tasks(12, seed=5)
  return tasks, zero_vision.conversations(tasks, pool, p_two_calls=0.5, seed=5)


def test_every_tool_call_runs_and_the_answer_is_the_ground_truth(generated, pool):
  tasks, convs = generated
  two_calls = 0
  for task, conv in zip(tasks, convs):
    assert [m.role for m in conv[:1]] == ["user"] and conv[0].content == task.question
    calls = [m for m in conv if m.call]
    two_calls += len(calls) == 2
    assert conv[-1] == chat.Message("assistant", task.answer)
    assert image_tasks.grade(conv[-2].content, task.answer)         # the last tool output states it
    assert task.image_name in calls[0].content
    # Rerun the trajectory's calls in a fresh session of their own: same outputs.
    with pool.session(images=task.images) as session:
      for call, output in zip(calls, [m for m in conv if m.role == "tool"]):
        result = session.run(call.content)
        assert result.ok, result.error
        assert result.stdout.rstrip("\n") == output.content
  assert 0 < two_calls < len(tasks)


def test_loss_mask_is_one_exactly_on_assistant_tokens(generated):
  tasks, convs = generated
  tok = chat.ChatTokenizer()
  data = zero_vision.encode(tok, convs, max_length=320)
  for row, conv in enumerate(convs):
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
    assert learned.endswith(tasks[row].answer + "<|end|>") and "<|tool|>" not in learned
    assert tasks[row].question not in learned


def test_shards_never_put_two_images_of_one_name_together():
  tasks = image_tasks.make_tasks(40, seed=1)
  groups = zero_vision.shards(tasks)
  assert sorted(i for g in groups for i in g) == list(range(40))
  for g in groups:
    assert len({tasks[i].image_name for i in g}) == len(g)


def test_too_long_conversations_are_refused(generated):
  with pytest.raises(ValueError, match="data.max_length"):
    zero_vision.encode(chat.ChatTokenizer(), generated[1], max_length=40)
