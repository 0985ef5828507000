"""Synthetic visual data with exact labels, drawn in numpy (no downloads, no fonts).

Every example is a pure function of (seed, index): rng = default_rng([seed, index]) and
the task is `tasks[index % len(tasks)]`. Tasks, their prompt and the exact answer:

    caption  56×56   1–2 shapes (square | circle | triangle) in red | green | blue |
                     yellow, each in its own quadrant       "caption:" → "red circle top left, blue square bottom right"
    count    56×56   1–4 shapes, each in its own quadrant             "count:"   → "3"
    read     56×56   a 3-digit number or a 3-letter word, 5×7 bitmap glyphs drawn ×2
                                                                      "read:"    → "407" | "CAT"
    chart    56×84   four bars of heights 1–5 units                   "chart:"   → "3 1 4 2"
    motion   4 frames 56×56 at 2 fps, one shape moving 7 px a frame   "motion:"  → "red square moving left"

Shapes are 12–18 px, colours jittered by up to ±24 per channel, on a dark noisy
background. A quadrant is 28×28 px: one merged token of the vision tower (2×2 patches of 14). Sizes come from a few buckets (56×56, 56×84, 4×56×56) so the vision tower
sees a bounded set of grids.

A `VisionSample` is the tokenized example: [BOS] + media blocks + prompt + " " + answer +
[EOS], the loss on the answer and EOS only (`answer_start`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from k25jax.data import vision

TASKS = ("caption", "count", "read", "chart", "motion")
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle", "triangle")
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
SIDE = 56
CHART_SIZE = (56, 84)
VIDEO_FRAMES = 4
COLOUR_JITTER = 24
WORDS = ("CAT", "DOG", "SUN", "BOX", "RED", "MAP", "HAT", "PEN", "CUP", "KEY", "BUS", "NET", "TOY", "BED",
         "CAR", "EGG", "HEN", "MUD", "NUT", "OAK", "PUP", "RAT", "SKY", "TEN", "URN", "YAK")

# 5×7 bitmap glyphs, one string of 7 rows per character ('#' = ink).
GLYPHS = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.", "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####", "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.", "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.", "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.", "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "A": ".###. #...# #...# ##### #...# #...# #...#", "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.", "D": "####. #...# #...# #...# #...# #...# ####.",
    "E": "##### #.... #.... ####. #.... #.... #####", "G": ".###. #...# #.... #.### #...# #...# .####",
    "H": "#...# #...# #...# ##### #...# #...# #...#", "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#", "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.", "P": "####. #...# #...# ####. #.... #.... #....",
    "R": "####. #...# #...# ####. #.#.. #..#. #...#", "S": ".#### #.... #.... .###. ....# ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..", "U": "#...# #...# #...# #...# #...# #...# .###.",
    "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#", "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..",
}


@dataclasses.dataclass(frozen=True)
class Example:
  """frames: uint8 [t, H, W, 3] (t = 1 for an image); the answer is exact by construction."""

  task: str
  frames: np.ndarray
  prompt: str
  answer: str


# ----------------------------------------------------------------------------- drawing
def glyph(char: str) -> np.ndarray:
  """bool [7, 5] bitmap of `char`."""
  if char not in GLYPHS:
    raise ValueError(f"no glyph for {char!r}; glyphs exist for {''.join(sorted(GLYPHS))}")
  return np.array([[c == "#" for c in row] for row in GLYPHS[char].split()], bool)


def shape_mask(shape: str, size: int, center: tuple[float, float], canvas: tuple[int, int]) -> np.ndarray:
  """bool [H, W]: a filled square, circle or upward triangle of side/diameter `size`."""
  y, x = np.mgrid[0:canvas[0], 0:canvas[1]] + 0.5
  dy, dx = y - center[0], x - center[1]
  half = size / 2
  if shape == "square":
    return (np.abs(dy) <= half) & (np.abs(dx) <= half)
  if shape == "circle":
    return dy * dy + dx * dx <= half * half
  if shape == "triangle":   # apex at the top, base at the bottom
    return (np.abs(dy) <= half) & (np.abs(dx) <= (dy + half) / 2)
  raise ValueError(f"shape={shape!r}; choose one of {SHAPES}")


def background(rng: np.random.Generator, canvas: tuple[int, int]) -> np.ndarray:
  base = rng.integers(0, 40)
  return np.clip(base + rng.normal(0, 6, (*canvas, 3)), 0, 255).astype(np.uint8)


def jittered(colour: str, rng: np.random.Generator) -> np.ndarray:
  """uint8 [3]: the named colour, each channel moved by up to ±COLOUR_JITTER."""
  rgb = np.array(COLOURS[colour]) + rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, 3)
  return np.clip(rgb, 0, 255).astype(np.uint8)


def paint(image: np.ndarray, mask: np.ndarray, colour: str, rng: np.random.Generator) -> None:
  image[mask] = jittered(colour, rng)


def draw_text(image: np.ndarray, text: str, top: int, left: int, scale: int, ink) -> None:
  """Glyphs of `text` at (top, left), each 5·scale wide with `scale` px between them."""
  for i, char in enumerate(text):
    bitmap = np.kron(glyph(char), np.ones((scale, scale), bool))
    x0 = left + i * 6 * scale
    image[top:top + bitmap.shape[0], x0:x0 + bitmap.shape[1]][bitmap] = ink


# ----------------------------------------------------------------------------- tasks
def draw_in_quadrant(image: np.ndarray, q: int, rng: np.random.Generator) -> tuple[str, str]:
  """A random shape of a random colour, 12–18 px, near the centre of quadrant q of a SIDE×SIDE
  image (±3 px); returns (shape, colour)."""
  shape, colour = SHAPES[rng.integers(len(SHAPES))], list(COLOURS)[rng.integers(len(COLOURS))]
  size = int(rng.integers(12, 19))
  center = (14 + 28 * (q // 2) + rng.uniform(-3, 3), 14 + 28 * (q % 2) + rng.uniform(-3, 3))
  paint(image, shape_mask(shape, size, center, image.shape[:2]), colour, rng)
  return shape, colour


def caption(rng: np.random.Generator) -> Example:
  image = background(rng, (SIDE, SIDE))
  quadrants = sorted(rng.choice(4, size=rng.integers(1, 3), replace=False))
  parts = []
  for q in quadrants:
    shape, colour = draw_in_quadrant(image, q, rng)
    parts.append(f"{colour} {shape} {QUADRANTS[q]}")
  return Example("caption", image[None], "caption:", ", ".join(parts))


def count(rng: np.random.Generator) -> Example:
  image = background(rng, (SIDE, SIDE))
  n = int(rng.integers(1, 5))
  for q in rng.choice(4, size=n, replace=False):
    shape, colour = SHAPES[rng.integers(len(SHAPES))], list(COLOURS)[rng.integers(len(COLOURS))]
    center = (14 + 28 * (q // 2) + rng.uniform(-3, 3), 14 + 28 * (q % 2) + rng.uniform(-3, 3))
    paint(image, shape_mask(shape, int(rng.integers(12, 19)), center, image.shape[:2]), colour, rng)
  return Example("count", image[None], "count:", str(n))


def read(rng: np.random.Generator) -> Example:
  image = background(rng, (SIDE, SIDE))
  text = WORDS[rng.integers(len(WORDS))] if rng.random() < 0.5 else f"{rng.integers(100, 1000)}"
  width = (6 * len(text) - 1) * 2
  ink = np.clip(rng.integers(180, 256) + rng.integers(-20, 21, 3), 0, 255).astype(np.uint8)
  draw_text(image, text, int(rng.integers(2, SIDE - 14 - 1)), int(rng.integers(1, SIDE - width)), 2, ink)
  return Example("read", image[None], "read:", text)


def chart(rng: np.random.Generator) -> Example:
  height, width = CHART_SIZE
  image = background(rng, CHART_SIZE)
  values = rng.integers(1, 6, size=4)
  colour = list(COLOURS)[rng.integers(len(COLOURS))]
  image[height - 4, 2:width - 2] = 200                 # the axis
  for i, v in enumerate(values):
    mask = np.zeros(CHART_SIZE, bool)
    left = 6 + 20 * i
    mask[height - 4 - 9 * v:height - 4, left:left + 12] = True
    paint(image, mask, colour, rng)
  return Example("chart", image[None], "chart:", " ".join(str(v) for v in values))


def motion(rng: np.random.Generator) -> Example:
  direction = list(DIRECTIONS)[rng.integers(len(DIRECTIONS))]
  shape, colour = SHAPES[rng.integers(len(SHAPES))], list(COLOURS)[rng.integers(len(COLOURS))]
  size, step = int(rng.integers(12, 17)), 7
  dy, dx = DIRECTIONS[direction]
  travel = step * (VIDEO_FRAMES - 1)
  start = [float(rng.uniform(size / 2 + 1, SIDE - size / 2 - 1)) for _ in range(2)]
  for axis, d in ((0, dy), (1, dx)):                   # leave room to travel along the motion
    if d:
      start[axis] = float(rng.uniform(size / 2 + 1, SIDE - size / 2 - 1 - travel))
      start[axis] = start[axis] if d > 0 else SIDE - start[axis]
  frames = np.repeat(background(rng, (SIDE, SIDE))[None], VIDEO_FRAMES, axis=0)
  rgb = jittered(colour, rng)
  for f in range(VIDEO_FRAMES):
    center = (start[0] + dy * step * f, start[1] + dx * step * f)
    frames[f][shape_mask(shape, size, center, (SIDE, SIDE))] = rgb
  return Example("motion", frames, "motion:", f"{colour} {shape} moving {direction}")


MAKERS = {"caption": caption, "count": count, "read": read, "chart": chart, "motion": motion}


def check_tasks(tasks: Sequence[str]) -> tuple[str, ...]:
  tasks = tuple(tasks)
  unknown = [t for t in tasks if t not in MAKERS]
  if not tasks or unknown:
    raise ValueError(f"vision tasks {list(tasks)}: unknown {unknown}; choose from {TASKS}")
  return tasks


def example(index: int, seed: int, tasks: Sequence[str] = TASKS) -> Example:
  """The `index`-th example of the stream `seed` (deterministic)."""
  tasks = check_tasks(tasks)
  return MAKERS[tasks[index % len(tasks)]](np.random.default_rng([seed, index]))


# ----------------------------------------------------------------------------- tokens
@dataclasses.dataclass(frozen=True)
class VisionSample:
  """tokens int32 [L] = [BOS] + media blocks + prompt + " " + answer + [EOS]; the loss covers
  tokens[answer_start:] (answer and EOS); media in the order of their blocks."""

  tokens: np.ndarray
  answer_start: int
  media: tuple[vision.Media, ...]
  task: str

  def __len__(self) -> int:
    return len(self.tokens)

  @property
  def num_patches(self) -> int:
    return sum(m.pixel_values.shape[0] for m in self.media)


def media_of(ex: Example) -> tuple[vision.Media, ...]:
  if ex.frames.shape[0] == 1:
    return (vision.preprocess_image(ex.frames[0]),)
  return tuple(vision.preprocess_video(ex.frames, video_fps=vision.VIDEO_FPS))


def to_sample(ex: Example, tok) -> VisionSample:
  media = media_of(ex)
  head = [tok.bos_id] + [i for m in media for i in vision.media_token_ids(m, tok)] + tok.encode(ex.prompt + " ")
  tokens = np.asarray(head + tok.encode(ex.answer) + [tok.eos_id], np.int32)
  return VisionSample(tokens, len(head), media, ex.task)


def sample(index: int, seed: int, tok, tasks: Sequence[str] = TASKS) -> VisionSample:
  return to_sample(example(index, seed, tasks), tok)


def caption_documents(n: int, seed: int, tasks: Sequence[str] = TASKS, lines: int = 8) -> list[str]:
  """`n` text documents of `lines` "prompt answer" lines each: the language of the synthetic
  tasks without their images (a text corpus for the language model the ViT stage aligns to)."""
  tasks = check_tasks(tasks)
  return ["\n".join(f"{ex.prompt} {ex.answer}" for ex in (example(d * lines + i, seed, tasks) for i in range(lines)))
          for d in range(n)]
