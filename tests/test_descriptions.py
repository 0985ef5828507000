"""The description task's hidden rubric, its corrupted descriptions and the judge's chats,
against hand-counted facts."""
import numpy as np
import pytest

from k25jax.data import chat, descriptions as d, judgements, tokenizer

TWO = (d.SceneObject("red", "circle", "top left"), d.SceneObject("blue", "square", "bottom right"))
FACTS = d.facts_of(TWO)      # count, red@top left, circle@top left, blue@bottom right, square@bottom right


def test_the_true_description_and_its_facts():
  assert d.describe(TWO) == "2 objects: red circle top left, blue square bottom right"
  assert d.describe(TWO[:1]) == "1 object: red circle top left"
  assert len(FACTS) == 5 and ("count", 2) in FACTS and ("shape", "bottom right", "square") in FACTS


@pytest.mark.parametrize("text, value", [
    ("2 objects: red circle top left, blue square bottom right", 1.0),
    ("2 objects: blue square bottom right, red circle top left.", 1.0),           # order and a full stop
    ("2 objects: red square top left", (2 - 1) / 5),                               # count, red; square false
    ("3 objects: red circle top left, blue square bottom right", (4 - 1) / 5),     # the count false
    ("2 objects: red circle top left, blue square bottom right, green circle top right", (5 - 2) / 5),
    ("2 objects: red circle top left, red circle top left", 3 / 5),                # a repeat claims nothing new
    ("2 objects: red circle top left, a cat", (3 - 1) / 5),                        # an unreadable clause: one false
    ("3 objects: green triangle top right, yellow square bottom left", 0.0),       # more false than true: 0
    ("red circle top left, blue square bottom right", 0.0),                        # no count prefix
    ("", 0.0), (None, 0.0)])
def test_the_rubric_counts_true_minus_false_claims_over_the_facts(text, value):
  assert d.rubric(text, FACTS) == pytest.approx(value)


def test_tasks_are_deterministic_scenes_of_one_to_four_objects_in_their_own_quadrants():
  a, b = d.make_tasks(40, seed=3), d.make_tasks(40, seed=3)
  assert all(np.array_equal(x.image, y.image) and x.objects == y.objects for x, y in zip(a, b))
  assert {len(t.objects) for t in a} == {1, 2, 3, 4}
  for t in a:
    assert t.image.shape == (56, 56, 3) and len({o.quadrant for o in t.objects}) == len(t.objects)
    assert t.grade(t.answer) and t.reward(t.answer) == 1.0 and t.kind == "describe" and t.image_name in t.question
  for t in a[:8]:      # the object's quadrant is brighter than an empty one (the shape is drawn there)
    for q, quadrant in enumerate(d.synthetic.QUADRANTS):
      patch = t.image[28 * (q // 2):28 * (q // 2) + 28, 28 * (q % 2):28 * (q % 2) + 28]
      assert (patch.max() > 120) == any(o.quadrant == quadrant for o in t.objects)


def test_corrupted_descriptions_lose_rubric_and_their_critique_scores_it():
  rng = np.random.default_rng(0)
  for t in d.make_tasks(60, seed=1):
    assert d.corrupt(rng, t.objects, 0) == t.answer
    wrong = d.corrupt(rng, t.objects, int(rng.integers(1, 4)))
    judged = d.critique(wrong, t.objects)
    assert judged.endswith(f"Score: {d.score_of(t.rubric(wrong))}/10")
    if wrong != t.answer:
      assert t.rubric(wrong) < 1.0 and not judged.startswith("correct")


def test_the_critique_names_the_errors():
  assert d.critique(d.describe(TWO), TWO) == "correct.\nScore: 10/10"
  text = "3 objects: green circle top left, blue square top right"
  # true: circle@top left; false: count 3, green@top left, blue@top right, square@top right -> max(0, 1 - 4) = 0
  assert d.critique(text, TWO) == ("wrong: count 3, green top left, blue square top right; missed: bottom right."
                                   "\nScore: 0/10")
  assert d.critique("red circle top left", TWO) == "no count.\nScore: 0/10"
  assert d.score_of(0.25) == 3 and d.score_of(0.249) == 2 and d.score_of(1.0) == 10


def test_the_judge_chat_learns_only_the_judgement_after_the_prompt_the_grm_writes():
  tok = tokenizer.ByteTokenizer(media=True, chat=True)
  made = judgements.chats(30, seed=0, tok=tok)
  rng = np.random.default_rng([0, 7177])       # the chats' draws, replayed
  for (ids, mask, media), task in zip(made, d.make_tasks(30, seed=0)):
    response = judgements.description_to_judge(rng, task)
    prompt = chat.render_ids(tok, judgements.messages(task.question, response, media.num_tokens),
                             add_generation_prompt=True)[0]
    first = mask.index(1.0)
    assert first == len(prompt) and ids[:first] == prompt and len(ids) <= 480
    assert media.num_tokens == ids.count(tok.special["<|media_pad|>"])
    learned = tok.decode(ids[first:])
    assert learned == d.critique(response, task.objects) + "<|im_end|>" and all(mask[first:])


def test_a_guess_keeps_the_layout_and_redraws_what_the_objects_are():
  rng = np.random.default_rng(0)
  t = d.make_tasks(1, seed=2)[0]
  assert d.guess(rng, t.objects, 0.0) == t.answer
  for _ in range(20):
    claimed = d.claims(d.guess(rng, t.objects, 1.0))
    assert ("count", len(t.objects)) in claimed
    assert {c[1] for c in claimed if c[0] == "colour"} == {o.quadrant for o in t.objects}
