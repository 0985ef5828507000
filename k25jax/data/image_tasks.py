"""Verifiable questions about synthetic images: counting, locating, comparing, reading.

Every task is one image (uint8 [S, S, 3], drawn here from its parameters) with a name
(`img_1`..`img_4`), a question that refers to the image by that name, the exact answer
(a short string, computed from the drawing parameters, not by the tool), and reference
tool programs that answer it with `k25jax.agents.image_ops` (one call, or two calls that
share state):

    count    "How many red objects are in img_2?"                 "3"
    locate   "Which quadrant of img_1 is the blue object in?"     "top left"
    compare  "Which half of img_3 is brighter, left or right?"    "right"
    read     "How wide is the green bar in img_1, in pixels?"     "17"

Scenes: a flat dark background (for `compare`, a different grey on each half), and
axis-aligned rectangles in `OBJECT_COLOURS`, each with its own colour jitter of at most
`JITTER` per channel (within image_ops' default tolerance), at least `GAP` pixels apart
so no two objects touch.
"""
from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("count", "locate", "compare", "read")
OBJECT_COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
                  "cyan": (0, 255, 255), "magenta": (255, 0, 255), "white": (255, 255, 255)}
IMAGE_NAMES = tuple(f"img_{i}" for i in range(1, 5))
JITTER = 16
GAP = 2
MAX_COUNT = 4
QUESTIONS = {
    "count": ("How many {colour} objects are in {img}?", "Count the {colour} objects in {img}."),
    "locate": ("Which quadrant of {img} is the {colour} object in?",
               "In which quadrant of {img} is the {colour} object?"),
    "compare": ("Which half of {img} is brighter, left or right?", "Is the left or the right half of {img} brighter?"),
    "read": ("How wide is the {colour} bar in {img}, in pixels?", "What is the width of the {colour} bar in {img}?"),
}

# Reference programs: one call, or two calls sharing state (the second reads the first's names).
PROGRAMS = {
    "count": ((('print(count_objects({img}, "{colour}"))',),
               ('m = colour_mask({img}, "{colour}")\nprint(m.sum())', "print(connected_components(m)[1])"))),
    "locate": ((('y, x = locate({img}, "{colour}")["centroid"]\nh, w = {img}.shape[:2]\n'
                 'print("top" if y < h / 2 else "bottom", "left" if x < w / 2 else "right")'),),
               ('box = locate({img}, "{colour}")["box"]\nprint(box)',
                'h, w = {img}.shape[:2]\nprint("top" if box[2] <= h / 2 else "bottom", '
                '"left" if box[3] <= w / 2 else "right")')),
    "compare": ((('h, w = {img}.shape[:2]\nr = compare_regions({img}, (0, 0, h, w // 2), (0, w // 2, h, w))\n'
                  'print("left" if r["brighter"] == "a" else "right")'),),
                ('h, w = {img}.shape[:2]\nr = compare_regions({img}, (0, 0, h, w // 2), (0, w // 2, h, w))\n'
                 'print(round(r["brightness_a"]), round(r["brightness_b"]))',
                 'print("left" if r["brighter"] == "a" else "right")')),
    "read": ((('y0, x0, y1, x1 = find_objects({img}, "{colour}")[0]["box"]\nprint(x1 - x0)',),
              ('objs = find_objects({img}, "{colour}")\nprint(len(objs), objs[0]["box"])',
               'y0, x0, y1, x1 = objs[0]["box"]\nprint(x1 - x0)'))),
}


@dataclasses.dataclass(frozen=True)
class ImageTask:
  """One question about one image. `programs` holds the reference tool programs: each a
  tuple of code strings, one per tool call, in order."""

  kind: str
  image_name: str
  image: np.ndarray
  question: str
  answer: str
  programs: tuple[tuple[str, ...], ...]

  @property
  def images(self) -> dict[str, np.ndarray]:
    return {self.image_name: self.image}

  def grade(self, answer: str | None) -> bool:
    return grade(answer, self.answer)

  def reward(self, answer: str | None) -> float:
    """The RL reward: 1 for a correct answer, else 0."""
    return float(self.grade(answer))


# ------------------------------------------------------------------------------ drawing
Rect = tuple[int, int, int, int]   # (y0, x0, y1, x1), half-open


def _apart(rect: Rect, others: list[Rect]) -> bool:
  y0, x0, y1, x1 = rect
  return all(y1 + GAP <= b0 or b1 + GAP <= y0 or x1 + GAP <= a0 or a1 + GAP <= x0 for b0, a0, b1, a1 in others)


def _place(rng: np.random.Generator, size: tuple[int, int], taken: list[Rect], area: Rect, tries: int = 200
           ) -> Rect | None:
  """A rectangle of `size` (h, w) inside `area`, GAP apart from `taken`; None if it does not fit."""
  h, w = size
  ay0, ax0, ay1, ax1 = area
  if ay1 - ay0 < h or ax1 - ax0 < w:
    return None
  for _ in range(tries):
    y0 = int(rng.integers(ay0, ay1 - h + 1))
    x0 = int(rng.integers(ax0, ax1 - w + 1))
    rect = (y0, x0, y0 + h, x0 + w)
    if _apart(rect, taken):
      return rect
  return None


def _jittered(rng: np.random.Generator, colour: str) -> np.ndarray:
  base = np.array(OBJECT_COLOURS[colour], np.int32)
  return np.clip(base + rng.integers(-JITTER, JITTER + 1, 3), 0, 255).astype(np.uint8)


def _draw(image: np.ndarray, rect: Rect, rgb: np.ndarray) -> None:
  y0, x0, y1, x1 = rect
  image[y0:y1, x0:x1] = rgb


def _background(rng: np.random.Generator, s: int) -> np.ndarray:
  return np.full((s, s, 3), int(rng.integers(0, 40)), np.uint8)


def _small_size(rng: np.random.Generator, s: int) -> tuple[int, int]:
  top = max(3, s // 8)
  return int(rng.integers(3, top + 1)), int(rng.integers(3, top + 1))


def _scatter(rng, image, taken: list[Rect], colours: list[str], area: Rect | None = None) -> bool:
  """Draws one small object of each colour in `colours`; False if one did not fit."""
  s = image.shape[0]
  for colour in colours:
    rect = _place(rng, _small_size(rng, s), taken, area or (0, 0, s, s))
    if rect is None:
      return False
    taken.append(rect)
    _draw(image, rect, _jittered(rng, colour))
  return True


def _others(rng, exclude: str, n: int) -> list[str]:
  names = [c for c in OBJECT_COLOURS if c != exclude]
  return [names[i] for i in rng.integers(0, len(names), n)]


# ------------------------------------------------------------------------------ task kinds
def _count(rng, s: int):
  colour = str(rng.choice(list(OBJECT_COLOURS)))
  n = int(rng.integers(0, MAX_COUNT + 1))
  image, taken = _background(rng, s), []
  if not _scatter(rng, image, taken, [colour] * n + _others(rng, colour, int(rng.integers(0, 4)))):
    return None
  return image, colour, str(n)


def _locate(rng, s: int):
  colour = str(rng.choice(list(OBJECT_COLOURS)))
  row, col = int(rng.integers(0, 2)), int(rng.integers(0, 2))
  half = s // 2
  image, taken = _background(rng, s), []
  quadrant = (row * half, col * half, row * half + half, col * half + half)
  if not (_scatter(rng, image, taken, [colour], quadrant)
          and _scatter(rng, image, taken, _others(rng, colour, int(rng.integers(1, 4))))):
    return None
  return image, colour, f"{('top', 'bottom')[row]} {('left', 'right')[col]}"


def _compare(rng, s: int):
  image, taken = _background(rng, s), []
  left, right = (int(v) for v in rng.integers(0, 200, 2))
  image[:, :s // 2] = left
  image[:, s // 2:] = right
  if not _scatter(rng, image, taken, _others(rng, "", int(rng.integers(0, 4)))):
    return None
  grey = image.astype(np.float64).mean(axis=-1)
  mean_left, mean_right = grey[:, :s // 2].mean(), grey[:, s // 2:].mean()
  if abs(mean_left - mean_right) < 20:
    return None
  return image, "", "left" if mean_left > mean_right else "right"


def _read(rng, s: int):
  colour = str(rng.choice(list(OBJECT_COLOURS)))
  height = int(rng.integers(2, 5))
  width = int(rng.integers(2 * height, s - 4 + 1))
  image, taken = _background(rng, s), []
  rect = _place(rng, (height, width), taken, (0, 0, s, s))
  if rect is None:
    return None
  taken.append(rect)
  _draw(image, rect, _jittered(rng, colour))
  if not _scatter(rng, image, taken, _others(rng, colour, int(rng.integers(0, 4)))):
    return None
  return image, colour, str(width)


_MAKERS = {"count": _count, "locate": _locate, "compare": _compare, "read": _read}


def make_task(rng: np.random.Generator, kind: str, image_size: int) -> ImageTask:
  """One task of `kind` on an image_size × image_size image (redrawn until the scene fits)."""
  if kind not in KINDS:
    raise ValueError(f"task kind {kind!r}; choose from {KINDS}")
  if image_size < 16 or image_size % 2:
    raise ValueError(f"image_size={image_size}: needs an even size of at least 16 pixels")
  while True:
    drawn = _MAKERS[kind](rng, image_size)
    if drawn is not None:
      break
  image, colour, answer = drawn
  img = IMAGE_NAMES[int(rng.integers(0, len(IMAGE_NAMES)))]
  question = QUESTIONS[kind][int(rng.integers(0, len(QUESTIONS[kind])))].format(colour=colour, img=img)
  programs = tuple(tuple(code.format(colour=colour, img=img) for code in program) for program in PROGRAMS[kind])
  return ImageTask(kind, img, image, question, answer, programs)


def parse_kinds(text: str, field: str) -> tuple[str, ...]:
  """The task kinds of a comma-separated config field (`field` names it in the error)."""
  names = tuple(k.strip() for k in text.split(",") if k.strip())
  if not names or set(names) - set(KINDS):
    raise ValueError(f"{field}={text!r}; a comma-separated subset of {KINDS}")
  return names


def make_tasks(n: int, seed: int, image_size: int = 56, kinds: tuple[str, ...] = KINDS) -> list[ImageTask]:
  """n tasks, kinds in turn (task i has kind kinds[i % len(kinds)]), deterministic given seed."""
  if not kinds or set(kinds) - set(KINDS):
    raise ValueError(f"kinds={kinds!r}; choose a non-empty subset of {KINDS}")
  rng = np.random.default_rng([seed, 1801])
  return [make_task(rng, kinds[i % len(kinds)], image_size) for i in range(n)]


def grade(answer: str | None, truth: str) -> bool:
  """Exact match after trimming whitespace and lowering case; no answer is wrong."""
  return answer is not None and " ".join(answer.split()).lower() == truth.lower()
