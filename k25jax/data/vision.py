"""Image and video preprocessing for MoonViT-3D, as transformers' K2.5 processor does it.

    image (PIL, uint8 array, encoded bytes or a path) → RGB uint8 [H, W, 3]
      → (h, w) = navit_size(H, W): scale s = min(1, √(max_patches / (⌊H/14⌋·⌊W/14⌋)),
        512·14 / H, 512·14 / W); never upscaled; h = max(1, ⌊H·s⌋), w likewise
      → bicubic resize to (h, w) (antialiased, uint8, exactly torch's kernel, which
        torchvision's `resize` runs for uint8 images on CPU)
      → zero-pad bottom/right to multiples of 28 (patch 14 × merge 2)
      → x / 255, then (x − 0.5) / 0.5   (pad pixels become −1)
      → pixel_values [gh·gw, 3, 14, 14] row-major over the patch grid, grid_thw (1, gh, gw)

A video is sampled at 2 fps (frame indices ⌊i·T / n⌋, n = max(1, ⌊T / fps_video · 2⌋)),
cut into chunks of 4 consecutive sampled frames, and every chunk is processed like an
image (one size for all its frames, video patch limit 4096): pixel_values
[t·gh·gw, 3, 14, 14] frame-major, grid_thw (t, gh, gw). The LAST chunk keeps the frames
it has (t = 1..4) and so does a video shorter than one chunk: transformers neither pads
nor rejects it, and the merger's mean over time handles any t.

The patch limit is checked on ⌊H/14⌋·⌊W/14⌋ BEFORE padding (transformers' rule), so a
padded grid can exceed it slightly: 2000×3000 becomes 1468×2202, padded 1484×2212,
106·158 = 16748 patches.

Each media item reaches the language model as a block of text and placeholders:

    image:  <|media_begin|>image<|media_content|>  N × <|media_pad|>  <|media_end|>
    video:  HH:MM:SS.mmm<|media_begin|>video<|media_content|>  N × <|media_pad|>  <|media_end|>
            (one block per chunk, stamped with the time of its first frame)

N = (gh/2)·(gw/2): the merger averages a chunk's frames and groups 2×2 patches, so a
chunk costs as many tokens as one of its frames. transformers 5.24 writes a separate
video placeholder (`<|kimi_k25_video_placeholder|>`) that its model fills the same
way; we use `<|media_pad|>` for both kinds, so the model fills every placeholder with
the projector outputs of all media, in order.
"""
from __future__ import annotations

import dataclasses
import io
import math
import os
import time
from typing import Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from k25jax.data.tokenizer import MEDIA_TOKENS

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_CHUNK = 4          # frames per video chunk (transformers' temporal_patch_size)
IMAGE_MAX_PATCHES = 16384
VIDEO_MAX_PATCHES = 4096    # per frame of a chunk
MAX_PATCHES_PER_SIDE = 512  # transformers' size = {"max_height": 512, "max_width": 512}, in patches
VIDEO_FPS = 2.0
MEAN = STD = 0.5
KINDS = ("image", "video")
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = MEDIA_TOKENS


@dataclasses.dataclass(frozen=True)
class Media:
  """One image or one video chunk, as the vision tower takes it.

  pixel_values: float32 [t·gh·gw, 3, 14, 14]; grid_thw: (t, gh, gw) in patches;
  timestamp: seconds of a video chunk's first frame (None for an image).
  """

  pixel_values: np.ndarray
  grid_thw: tuple[int, int, int]
  kind: str = "image"
  timestamp: float | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Media.kind={self.kind!r}; choose one of {KINDS}")
    t, h, w = self.grid_thw
    if self.pixel_values.shape[0] != t * h * w:
      raise ValueError(f"Media.pixel_values has {self.pixel_values.shape[0]} patches but grid_thw="
                       f"{self.grid_thw} needs {t * h * w}")

  @property
  def num_tokens(self) -> int:
    return num_media_tokens(self.grid_thw)


def num_media_tokens(grid_thw: Sequence[int], merge_size: int = MERGE_SIZE) -> int:
  """Placeholders of one item: (gh / m)·(gw / m); the frames of a chunk are averaged."""
  _, h, w = grid_thw
  if h % merge_size or w % merge_size:
    raise ValueError(f"grid_thw={tuple(grid_thw)}: height and width must be multiples of merge_size={merge_size}")
  return (h // merge_size) * (w // merge_size)


# ----------------------------------------------------------------------------- decoding
def _rgb(image: Image.Image) -> Image.Image:
  """A PIL image as RGB the way transformers' `convert_to_rgb` does it: an image with alpha
  (an alpha band, or a palette's transparency) is composited onto opaque white
  (`Image.alpha_composite`); any other mode is converted."""
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
  return image.convert("RGB")


def load_image(image) -> np.ndarray:
  """RGB uint8 [H, W, 3] from a PIL image, a uint8 array ([H, W], [H, W, 1|3|4]), encoded
  bytes or a file path, as transformers' `convert_to_rgb` makes it: transparency is
  composited onto white (PIL images: `Image.alpha_composite`; [H, W, 4] arrays:
  round(a · rgb + (1 − a) · 255), a = alpha / 255), grey is repeated, other modes
  converted. Undecodable data and empty images are ValueErrors."""
  if isinstance(image, (bytes, bytearray, str, os.PathLike)):
    source = io.BytesIO(image) if isinstance(image, (bytes, bytearray)) else image
    name = "image bytes" if isinstance(image, (bytes, bytearray)) else f"image file {os.fspath(image)!r}"
    try:
      with Image.open(source) as opened:
        opened.load()
        image = _rgb(opened)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
      raise ValueError(f"{name}: cannot decode ({type(e).__name__}: {e}); the file is corrupt or not an image") from e
  if isinstance(image, Image.Image):
    if image.width == 0 or image.height == 0:
      raise ValueError(f"image has zero size ({image.width}x{image.height})")
    return np.asarray(_rgb(image))
  array = np.asarray(image)
  if array.dtype != np.uint8:
    raise ValueError(f"image array must be uint8 (0..255), got {array.dtype}")
  if array.ndim == 3 and array.shape[-1] == 1:
    array = array[..., 0]
  if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
    raise ValueError(f"image array must be [H, W], [H, W, 1], [H, W, 3] or [H, W, 4], got shape {array.shape}")
  if array.shape[0] == 0 or array.shape[1] == 0:
    raise ValueError(f"image has zero size (shape {array.shape})")
  if array.ndim == 3 and array.shape[-1] == 3:
    return np.ascontiguousarray(array)
  if array.ndim == 3:                                     # RGBA
    alpha = array[..., 3:4] / 255
    return np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
  return np.repeat(array[..., None], 3, axis=-1)


# ----------------------------------------------------------------------------- resizing
def navit_size(height: int, width: int, *, max_patches: int = IMAGE_MAX_PATCHES,
               patch_size: int = PATCH_SIZE, merge_size: int = MERGE_SIZE,
               max_patches_per_side: int = MAX_PATCHES_PER_SIDE) -> tuple[tuple[int, int], tuple[int, int]]:
  """((h, w) resized, (h, w) padded) by the rule in the module docstring."""
  if height <= 0 or width <= 0:
    raise ValueError(f"image has zero size ({height}x{width})")
  patches = max(1, height // patch_size) * max(1, width // patch_size)
  side = max_patches_per_side * patch_size
  scale = min(1.0, math.sqrt(max_patches / patches), side / height, side / width)
  new_h = min(max(1, int(height * scale)), side)
  new_w = min(max(1, int(width * scale)), side)
  factor = merge_size * patch_size
  return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
  """Keys' cubic convolution kernel with a = −0.5 (PIL's and torch's antialiased bicubic)."""
  x = np.abs(x)
  near = ((a + 2) * x - (a + 3)) * x * x + 1
  far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
  return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def resample_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Fixed-point weights of antialiased bicubic resampling along one axis.

  Output i reads inputs xmin_i + j (j < taps) with weights, in float64,
      c = s·(i + ½),  s = in / out,  support = 2·max(s, 1)
      xmin = max(⌊c − support + ½⌋, 0),  xmax = min(⌊c + support + ½⌋, in)
      w_j = K((xmin + j − c + ½) / max(s, 1)),  normalised to Σ_j w_j = 1,
  then rounded to int16 at the largest precision p (< 22 bits) with
  round(max w · 2^(p+1)) < 2^15, as torch's uint8 kernel does.
  Returns (xmin int64 [out], weights int32 [out, taps] (0 beyond xmax), p).
  """
  scale = in_size / out_size
  support = 2.0 * max(scale, 1.0)
  taps = int(math.ceil(support)) * 2 + 1
  center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
  xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)
  xmax = np.minimum((center + support + 0.5).astype(np.int64), in_size)
  j = np.arange(taps)
  w = _cubic((j[None, :] + xmin[:, None] - center[:, None] + 0.5) / max(scale, 1.0))
  w = np.where(j[None, :] < (xmax - xmin)[:, None], w, 0.0)
  total = w.sum(axis=1, keepdims=True)
  w = np.where(total != 0.0, w / np.where(total != 0.0, total, 1.0), w)
  precision = 0
  while precision < 22 and int(0.5 + w.max() * (1 << (precision + 1))) < (1 << 15):
    precision += 1
  scaled = w * (1 << precision)
  fixed = np.where(scaled < 0, scaled - 0.5, scaled + 0.5).astype(np.int64)   # rounds half away from 0
  return xmin, fixed.astype(np.int32), precision


def _resample_axis(image: np.ndarray, axis: int, out_size: int) -> np.ndarray:
  in_size = image.shape[axis]
  xmin, weights, precision = resample_weights(in_size, out_size)
  x = np.moveaxis(image, axis, 0).astype(np.int32)
  acc = np.full((out_size,) + x.shape[1:], 1 << (precision - 1), np.int32)
  broadcast = (-1,) + (1,) * (x.ndim - 1)
  for j in range(weights.shape[1]):
    acc += x[np.minimum(xmin + j, in_size - 1)] * weights[:, j].reshape(broadcast)
  return np.moveaxis(np.clip(acc >> precision, 0, 255).astype(np.uint8), 0, axis)


def resize_bicubic(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """uint8 [..., H, W, C] → [..., height, width, C]: antialiased bicubic, horizontal pass
  first, each pass rounded to uint8 (bit-exact with torch's uint8 `interpolate(mode="bicubic",
  antialias=True)`). An axis whose size does not change is left alone."""
  if image.dtype != np.uint8:
    raise ValueError(f"resize_bicubic needs uint8 pixels, got {image.dtype}")
  if image.shape[-2] != width:
    image = _resample_axis(image, image.ndim - 2, width)
  if image.shape[-3] != height:
    image = _resample_axis(image, image.ndim - 3, height)
  return image


# ----------------------------------------------------------------------------- patches
def normalize_and_patchify(frames: np.ndarray, patch_size: int = PATCH_SIZE) -> np.ndarray:
  """uint8 [t, H, W, 3] (H, W multiples of the patch) → float32 [t·gh·gw, 3, p, p],
  (x / 255 − mean) / std, patches frame-major then row-major (transformers' layout)."""
  t, height, width, channels = frames.shape
  gh, gw = height // patch_size, width // patch_size
  x = (frames.astype(np.float32) / np.float32(255.0) - np.float32(MEAN)) / np.float32(STD)
  x = x.reshape(t, gh, patch_size, gw, patch_size, channels).transpose(0, 1, 3, 5, 2, 4)
  return np.ascontiguousarray(x.reshape(t * gh * gw, channels, patch_size, patch_size))


def _resize_and_pad(frames: np.ndarray, max_patches: int) -> tuple[np.ndarray, tuple[int, int]]:
  """uint8 [t, H, W, 3] → uint8 [t, H', W', 3] resized and zero-padded; returns (frames, (gh, gw))."""
  (h, w), (ph, pw) = navit_size(frames.shape[1], frames.shape[2], max_patches=max_patches)
  frames = resize_bicubic(frames, h, w)
  padded = np.zeros((frames.shape[0], ph, pw, 3), np.uint8)
  padded[:, :h, :w] = frames
  return padded, (ph // PATCH_SIZE, pw // PATCH_SIZE)


def preprocess_image(image, *, max_patches: int = IMAGE_MAX_PATCHES) -> Media:
  """One image → `Media` (grid (1, gh, gw)); larger than `max_patches` is scaled down."""
  frames, (gh, gw) = _resize_and_pad(load_image(image)[None], max_patches)
  return Media(normalize_and_patchify(frames), (1, gh, gw), "image")


def sample_frame_indices(total_frames: int, video_fps: float, fps: float = VIDEO_FPS) -> np.ndarray:
  """transformers' fps sampling: n = max(1, ⌊T / video_fps · fps⌋), indices ⌊i·T / n⌋."""
  if total_frames <= 0:
    raise ValueError(f"video has no frames (total_frames={total_frames})")
  if video_fps <= 0:
    raise ValueError(f"video_fps must be positive, got {video_fps}")
  n = max(1, int(total_frames / video_fps * fps))
  return np.arange(n, dtype=np.int64) * total_frames // n


def preprocess_video(frames, video_fps: float, *, fps: float = VIDEO_FPS, chunk: int = TEMPORAL_CHUNK,
                     max_patches: int = VIDEO_MAX_PATCHES) -> list[Media]:
  """A video (uint8 [T, H, W, 3] or a sequence of images) → one `Media` per chunk of
  `chunk` sampled frames; the last chunk (or a short video's only one) keeps t < chunk frames."""
  if not isinstance(frames, np.ndarray):
    frames = [load_image(f) for f in frames]
    if len({f.shape for f in frames}) > 1:
      raise ValueError(f"video frames differ in size: {sorted({f.shape for f in frames})}")
    frames = np.stack(frames) if frames else np.zeros((0, 1, 1, 3), np.uint8)
  if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
    raise ValueError(f"video frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
  indices = sample_frame_indices(len(frames), video_fps, fps)
  if 0 in frames.shape[1:3]:
    raise ValueError(f"video frames have zero size (shape {frames.shape})")
  sampled = frames[indices]
  out = []
  for start in range(0, len(sampled), chunk):
    piece, (gh, gw) = _resize_and_pad(sampled[start:start + chunk], max_patches)
    out.append(Media(normalize_and_patchify(piece), (len(piece), gh, gw), "video",
                     timestamp=float(indices[start] / video_fps)))
  return out


# ----------------------------------------------------------------------------- tokens
def timestamp_text(seconds: float) -> str:
  """`HH:MM:SS.mmm`, transformers' chunk stamp."""
  return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"


def media_text(media: Media) -> str:
  """The prompt text of one item (module docstring), placeholders spelled out."""
  block = f"{MEDIA_BEGIN}{media.kind}{MEDIA_CONTENT}{MEDIA_PAD * media.num_tokens}{MEDIA_END}"
  return block if media.kind == "image" else timestamp_text(media.timestamp or 0.0) + block


def media_token_ids(media: Media, tokenizer) -> list[int]:
  """Token ids of `media_text(media)`; `tokenizer` needs media ids (`tokenizer.media`)."""
  ids = getattr(tokenizer, "media", None)
  if ids is None:
    raise ValueError("the tokenizer has no media tokens: load it with media=True (data.media_tokens)")
  stamp = [] if media.kind == "image" else tokenizer.encode(timestamp_text(media.timestamp or 0.0))
  return [*stamp, ids.begin, *tokenizer.encode(media.kind), ids.content, *[ids.pad] * media.num_tokens, ids.end]


def pack_media(items: Sequence[Media]) -> tuple[np.ndarray, tuple[tuple[int, int, int], ...]]:
  """(pixel_values of all items concatenated [Σ patches, 3, 14, 14], grid_thw per item):
  NaViT packing, in the order their placeholders appear in the tokens."""
  if not items:
    return np.zeros((0, 3, PATCH_SIZE, PATCH_SIZE), np.float32), ()
  return np.concatenate([m.pixel_values for m in items]), tuple(m.grid_thw for m in items)
