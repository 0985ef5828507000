"""Image tasks: every answer checked against the pixels by an independent NumPy/SciPy reading."""
import numpy as np
import pytest
from scipy import ndimage

from k25jax.data import image_tasks

TASKS = image_tasks.make_tasks(160, seed=3, image_size=56)


def _mask(image, colour):
  rgb = np.array(image_tasks.OBJECT_COLOURS[colour], np.int16)
  return np.abs(image.astype(np.int16) - rgb).max(-1) <= image_tasks.JITTER


def _colour_of(question):
  return next(c for c in image_tasks.OBJECT_COLOURS if f" {c} " in question)


@pytest.mark.parametrize("kind", image_tasks.KINDS)
def test_answers_match_an_independent_reading_of_the_pixels(kind):
  chosen = [t for t in TASKS if t.kind == kind]
  assert len(chosen) == 40
  for t in chosen:
    assert t.image.shape == (56, 56, 3) and t.image.dtype == np.uint8 and t.image_name in t.question
    if kind == "compare":
      grey = t.image.astype(float).mean(-1)
      truth = "left" if grey[:, :28].mean() > grey[:, 28:].mean() else "right"
    else:
      mask = _mask(t.image, _colour_of(t.question))
      if kind == "count":
        truth = str(ndimage.label(mask)[1])
      elif kind == "locate":
        ys, xs = np.nonzero(mask)
        assert ys.max() < 28 or ys.min() >= 28, "the object straddles two quadrants"
        assert xs.max() < 28 or xs.min() >= 28, "the object straddles two quadrants"
        truth = f"{'top' if ys.max() < 28 else 'bottom'} {'left' if xs.max() < 28 else 'right'}"
      else:
        labels, n = ndimage.label(mask)
        assert n == 1
        xs = np.nonzero(mask)[1]
        truth = str(xs.max() - xs.min() + 1)
    assert t.answer == truth, (t.question, t.answer, truth)


def test_answers_are_spread_over_their_values():
  counts = {t.answer for t in TASKS if t.kind == "count"}
  assert counts == {str(n) for n in range(image_tasks.MAX_COUNT + 1)}
  assert {t.answer for t in TASKS if t.kind == "locate"} == {"top left", "top right", "bottom left", "bottom right"}
  assert {t.answer for t in TASKS if t.kind == "compare"} == {"left", "right"}


def test_generation_is_deterministic_and_grading_is_exact():
  again = image_tasks.make_tasks(8, seed=3, image_size=56)
  assert [t.question for t in again] == [t.question for t in TASKS[:8]]
  assert all(np.array_equal(a.image, b.image) for a, b in zip(again, TASKS))
  assert image_tasks.grade(" Top  left\n", "top left") and not image_tasks.grade("3.0", "3")
  assert not image_tasks.grade(None, "3")
  task = TASKS[0]
  assert task.reward(task.answer) == 1.0 and task.reward(task.answer + "0") == 0.0 and task.reward(None) == 0.0


def test_bad_requests_name_the_field():
  with pytest.raises(ValueError, match="kinds"):
    image_tasks.make_tasks(2, 0, kinds=("colour",))
  with pytest.raises(ValueError, match="image_size"):
    image_tasks.make_tasks(2, 0, image_size=15)
