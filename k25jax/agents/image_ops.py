"""Image operations for the zero-vision Python tool: pure NumPy, no SciPy, no model.

The zero-vision SFT trajectories call these from model-written code in the sandbox
(`k25jax/agents/sandbox.py`), where they are in the namespace without an import.

Conventions (every function checks its inputs and names the bad one in a ValueError):

* An image is a uint8 array [H, W, 3] (RGB). `binarize` and `brightness` also take a
  uint8 grey image [H, W].
* A mask is a bool array [H, W].
* A colour is a palette name (`PALETTE`: red, green, blue, yellow, cyan, magenta,
  orange, purple, white, black, grey) or an (r, g, b) triple of ints in 0..255.
* A pixel has a colour c when max_ch |pixel_ch - c_ch| <= tol (Chebyshev distance,
  `DEFAULT_TOL` = 40 unless given).
* A box is (y0, x0, y1, x1), half-open like a NumPy slice: rows y0..y1-1, columns
  x0..x1-1, so `crop(img, box)` is `img[y0:y1, x0:x1]`.
* Objects are the 4-connected components of a mask (pixels sharing an edge),
  numbered 1..n in raster order of their first (top-most, then left-most) pixel.
* Results are plain Python ints, floats, tuples, lists and dicts, so they print cleanly.
"""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np

__all__ = (
    "PALETTE", "DEFAULT_TOL", "brightness", "binarize", "colour_mask", "count_pixels",
    "connected_components", "bounding_boxes", "count_objects", "find_objects", "crop",
    "compare_regions", "locate",
)

PALETTE = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "cyan": (0, 255, 255),
    "magenta": (255, 0, 255),
    "orange": (255, 128, 0),
    "purple": (128, 0, 128),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "grey": (128, 128, 128),
}
DEFAULT_TOL = 40

Colour = Union[str, Sequence[int]]
Box = tuple[int, int, int, int]


# ----------------------------------------------------------------- input checks
def _image(img, name: str = "img", allow_grey: bool = False) -> np.ndarray:
  img = np.asarray(img)
  shapes = "[H, W, 3]" + (" or [H, W]" if allow_grey else "")
  grey_ok = allow_grey and img.ndim == 2
  if not (grey_ok or (img.ndim == 3 and img.shape[-1] == 3)):
    raise ValueError(f"{name} must be a uint8 image {shapes}, got shape {img.shape}")
  if img.dtype != np.uint8:
    raise ValueError(f"{name} must have dtype uint8, got {img.dtype}")
  if img.shape[0] == 0 or img.shape[1] == 0:
    raise ValueError(f"{name} is empty (shape {img.shape})")
  return img


def _mask(mask, name: str = "mask") -> np.ndarray:
  mask = np.asarray(mask)
  if mask.ndim != 2 or mask.dtype != np.bool_:
    raise ValueError(f"{name} must be a bool array [H, W], got {mask.dtype} of shape {mask.shape}")
  return mask


def _colour(colour: Colour) -> np.ndarray:
  if isinstance(colour, str):
    if colour not in PALETTE:
      raise ValueError(f"colour {colour!r} is not in the palette {sorted(PALETTE)}")
    return np.array(PALETTE[colour], np.int16)
  rgb = np.asarray(colour)
  if rgb.shape != (3,) or not np.issubdtype(rgb.dtype, np.integer) or rgb.min() < 0 or rgb.max() > 255:
    raise ValueError(f"colour must be a palette name or an (r, g, b) triple of ints in 0..255, got {colour!r}")
  return rgb.astype(np.int16)


def _box(box, shape: tuple[int, ...], name: str = "box") -> Box:
  try:
    y0, x0, y1, x1 = (int(v) for v in box)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be (y0, x0, y1, x1), got {box!r}") from None
  height, width = shape[:2]
  if not (0 <= y0 < y1 <= height and 0 <= x0 < x1 <= width):
    raise ValueError(f"{name} {box!r} is empty or outside the image of height {height} and width {width}")
  return y0, x0, y1, x1


# ----------------------------------------------------------------- pixels
def brightness(img) -> np.ndarray:
  """Per-pixel brightness, float64 [H, W]: the mean of R, G and B (a grey image is its own value)."""
  img = _image(img, allow_grey=True)
  return img.astype(np.float64) if img.ndim == 2 else img.astype(np.float64).mean(axis=-1)


def binarize(img, threshold: float = 127.5) -> np.ndarray:
  """Bool mask [H, W]: True where brightness(img) > threshold (threshold in 0..255)."""
  if not 0 <= threshold <= 255:
    raise ValueError(f"threshold must be in 0..255, got {threshold!r}")
  return brightness(img) > threshold


def colour_mask(img, colour: Colour, tol: int = DEFAULT_TOL) -> np.ndarray:
  """Bool mask [H, W]: True where max over channels of |img - colour| <= tol."""
  img = _image(img)
  if not 0 <= tol <= 255:
    raise ValueError(f"tol must be in 0..255, got {tol!r}")
  return np.abs(img.astype(np.int16) - _colour(colour)).max(axis=-1) <= tol


def count_pixels(img, colour: Colour, tol: int = DEFAULT_TOL) -> int:
  """Number of pixels of `colour` (see `colour_mask`)."""
  return int(colour_mask(img, colour, tol).sum())


# ----------------------------------------------------------------- objects
def _row_runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The horizontal runs of True in raster order: (row, start, end) arrays, end exclusive."""
  padded = np.pad(mask.astype(np.int8), ((0, 0), (1, 1)))
  edges = np.diff(padded, axis=1)
  rows, starts = np.nonzero(edges == 1)
  _, ends = np.nonzero(edges == -1)   # row-major order: the k-th end closes the k-th start
  return rows, starts, ends


def connected_components(mask) -> tuple[np.ndarray, int]:
  """4-connected components of a bool mask: (labels int32 [H, W], n).

  labels is 0 on background and k in 1..n on the k-th component, components numbered in
  raster order of their first pixel. Union-find over the mask's horizontal runs: two runs
  on adjacent rows join when their column ranges overlap (start_a < end_b and start_b < end_a).
  """
  mask = _mask(mask)
  rows, starts, ends = _row_runs(mask)
  parent = list(range(len(rows)))

  def root(i: int) -> int:
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  row_first = np.searchsorted(rows, np.arange(mask.shape[0] + 1))   # runs of row r: row_first[r]:row_first[r+1]
  for r in range(mask.shape[0] - 1):
    a, a_end = row_first[r], row_first[r + 1]
    b, b_end = row_first[r + 1], row_first[r + 2]
    while a < a_end and b < b_end:   # two pointers over the sorted runs of rows r and r+1
      if starts[a] < ends[b] and starts[b] < ends[a]:
        ra, rb = root(a), root(b)
        if ra != rb:
          parent[max(ra, rb)] = min(ra, rb)   # the smaller index is the earlier run in raster order
      if ends[a] <= ends[b]:
        a += 1
      else:
        b += 1

  labels = np.zeros(mask.shape, np.int32)
  label_of_root: dict[int, int] = {}
  for i in range(len(rows)):
    label = label_of_root.setdefault(root(i), len(label_of_root) + 1)
    labels[rows[i], starts[i]:ends[i]] = label
  return labels, len(label_of_root)


def bounding_boxes(mask) -> list[Box]:
  """One box (y0, x0, y1, x1), half-open, per 4-connected component, in label order."""
  labels, n = connected_components(mask)
  boxes = []
  for k in range(1, n + 1):
    ys, xs = np.nonzero(labels == k)
    boxes.append((int(ys.min()), int(xs.min()), int(ys.max()) + 1, int(xs.max()) + 1))
  return boxes


def _region(ys: np.ndarray, xs: np.ndarray) -> dict:
  return {
      "pixels": int(len(ys)),
      "box": (int(ys.min()), int(xs.min()), int(ys.max()) + 1, int(xs.max()) + 1),
      "centroid": (float(ys.mean()), float(xs.mean())),
  }


def find_objects(img, colour: Colour, tol: int = DEFAULT_TOL, min_pixels: int = 1) -> list[dict]:
  """The objects of `colour` with at least `min_pixels` pixels, in label order, each a dict
  {"pixels": int, "box": (y0, x0, y1, x1), "centroid": (mean row, mean column)}."""
  if min_pixels < 1:
    raise ValueError(f"min_pixels must be >= 1, got {min_pixels!r}")
  labels, n = connected_components(colour_mask(img, colour, tol))
  objects = []
  for k in range(1, n + 1):
    ys, xs = np.nonzero(labels == k)
    if len(ys) >= min_pixels:
      objects.append(_region(ys, xs))
  return objects


def count_objects(img, colour: Colour, tol: int = DEFAULT_TOL, min_pixels: int = 1) -> int:
  """Number of 4-connected objects of `colour` with at least `min_pixels` pixels."""
  return len(find_objects(img, colour, tol, min_pixels))


def locate(img, colour: Colour, tol: int = DEFAULT_TOL) -> dict | None:
  """Where `colour` is, over ALL its pixels (objects together): a dict {"pixels",
  "box", "centroid"} as in `find_objects`, or None when the image has no such pixel."""
  ys, xs = np.nonzero(colour_mask(img, colour, tol))
  return _region(ys, xs) if len(ys) else None


# ----------------------------------------------------------------- regions
def crop(img, box) -> np.ndarray:
  """A copy of img[y0:y1, x0:x1] for box (y0, x0, y1, x1); the box must be non-empty and inside."""
  img = _image(img, allow_grey=True)
  y0, x0, y1, x1 = _box(box, img.shape)
  return img[y0:y1, x0:x1].copy()


def compare_regions(img, box_a, box_b, colour: Colour | None = None, tol: int = DEFAULT_TOL) -> dict:
  """Compares two boxes of one image.

  Returns {"brightness_a", "brightness_b": mean brightness of each box,
  "brightness_diff": brightness_a - brightness_b, "brighter": "a" | "b" | "equal"},
  and with a `colour` also {"pixels_a", "pixels_b": pixels of that colour in each box,
  "more": "a" | "b" | "equal" (which box has more of it)}.
  """
  img = _image(img)
  regions = {"a": crop(img, _box(box_a, img.shape, "box_a")), "b": crop(img, _box(box_b, img.shape, "box_b"))}

  def winner(a, b) -> str:
    return "a" if a > b else "b" if b > a else "equal"

  mean_a, mean_b = (float(brightness(r).mean()) for r in regions.values())
  result = {"brightness_a": mean_a, "brightness_b": mean_b, "brightness_diff": mean_a - mean_b,
            "brighter": winner(mean_a, mean_b)}
  if colour is not None:
    count_a, count_b = (count_pixels(r, colour, tol) for r in regions.values())
    result.update(pixels_a=count_a, pixels_b=count_b, more=winner(count_a, count_b))
  return result
