"""Synthetic visual tasks: every label is checked against the pixels, independently of the drawing code."""
import numpy as np
import pytest
from scipy import ndimage

from k25jax.data import tokenizer, visual_synthetic as vs

N = 24   # examples per task


def ink(image: np.ndarray) -> np.ndarray:
  """Pixels of drawn objects: far brighter than the dark noisy background (< ~70)."""
  return image.max(axis=-1) > 120


def colour_of(pixels: np.ndarray) -> str:
  """Nearest named colour to the mean of `pixels` [n, 3]."""
  mean = pixels.reshape(-1, 3).mean(0)
  return min(vs.COLOURS, key=lambda c: np.abs(np.array(vs.COLOURS[c]) - mean).sum())


def examples(task):
  return [vs.example(i, seed=3, tasks=(task,)) for i in range(N)]


def test_count_equals_connected_components():
  for ex in examples("count"):
    _, n = ndimage.label(ink(ex.frames[0]))
    assert str(n) == ex.answer


def test_caption_names_each_object_colour_and_quadrant():
  for ex in examples("caption"):
    labels, n = ndimage.label(ink(ex.frames[0]))
    described = []
    for k in range(1, n + 1):
      ys, xs = np.nonzero(labels == k)
      quadrant = vs.QUADRANTS[2 * int(ys.mean() >= 28) + int(xs.mean() >= 28)]
      described.append((quadrant, colour_of(ex.frames[0][ys, xs])))
    stated = [(" ".join(p.split()[2:]), p.split()[0]) for p in ex.answer.split(", ")]
    assert sorted(described) == sorted(stated), ex.answer


def test_chart_values_are_bar_heights():
  for ex in examples("chart"):
    image = ex.frames[0]
    heights = []
    for i in range(4):
      column = ink(image[:, 6 + 20 * i + 6])[:-4]     # the bar's middle column, above the axis row
      heights.append(int(column.sum()) // 9)
    assert " ".join(map(str, heights)) == ex.answer


def test_motion_direction_matches_the_centroids():
  for ex in examples("motion"):
    centroids = np.array([np.argwhere(ink(f)).mean(0) for f in ex.frames])
    dy, dx = centroids[-1] - centroids[0]
    direction = ("down" if dy > 0 else "up") if abs(dy) > abs(dx) else ("right" if dx > 0 else "left")
    assert ex.answer.endswith(f"moving {direction}"), (ex.answer, dy, dx)
    assert ex.answer.split()[0] == colour_of(ex.frames[0][ink(ex.frames[0])])


def test_read_renders_one_glyph_block_per_character():
  for ex in examples("read"):
    columns = ink(ex.frames[0]).any(axis=0)
    starts = np.flatnonzero(columns[1:] & ~columns[:-1]) + 1
    assert len(starts) == len(ex.answer) == 3           # glyphs are separated by blank columns
    assert ex.answer in vs.WORDS or (ex.answer.isdigit() and 100 <= int(ex.answer) <= 999)


def test_samples_are_deterministic_and_tokenized_as_blocks():
  tok = tokenizer.ByteTokenizer(media=True)
  a, b = vs.sample(7, seed=1, tok=tok), vs.sample(7, seed=1, tok=tok)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  text = tok.decode(a.tokens[1:])
  assert text.startswith("<|media_begin|>") and tok.decode(a.tokens[a.answer_start:-1]) == vs.example(7, 1).answer
  video = vs.sample(4, seed=0, tok=tok)                 # index 4 → motion
  assert video.task == "motion" and [m.grid_thw for m in video.media] == [(4, 4, 4)]
  assert tok.decode(video.tokens[1:13]) == "00:00:00.000"


def test_unknown_task_is_an_error():
  with pytest.raises(ValueError, match="unknown"):
    vs.example(0, 0, tasks=("caption", "poetry"))
