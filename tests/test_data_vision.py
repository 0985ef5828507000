"""Image / video preprocessing against transformers' K2.5 processors and torch's resize kernel.

transformers' processors need torchvision; where it cannot be imported (this project's
CPU machines: the registry's torchvision wheel is a CUDA build that does not load on
torch+cpu) the direct comparisons skip, and the same inputs are checked against digests
of transformers' output recorded with transformers 5.24 + torchvision 0.28.0
(`python tests/test_data_vision.py` prints them where torchvision imports).
"""
import hashlib
import io

import numpy as np
import pytest
import torch
from PIL import Image

from k25jax.data import tokenizer, vision

# (height, width, max_patches): no resize, the 16384-patch limit, tiny, very wide (no
# resize), wider than 512 patches per side, a small patch budget, odd sizes, tall.
IMAGE_CASES = [(100, 150, 16384), (1820, 1820, 16384), (7, 9, 16384), (20, 2000, 16384),
               (30, 8000, 16384), (300, 300, 64), (299, 301, 100), (700, 90, 16384)]
# (frames, fps of the source, height, width): chunks of 4 + 3 frames; one frame only.
VIDEO_CASES = [(23, 6.0, 60, 90), (3, 30.0, 40, 40)]
RECORDED = {   # sha256 of (grid_thw, pixel values mapped back to uint8) of transformers' output
    (100, 150, 16384): "0888d392aa9eb93684fd1fbf269b1748e51d0bd7344f2dff2c14bed38053dd69",
    (1820, 1820, 16384): "ec9f20c771f2a226d14511edea54c81212a173faad31d6d560b4e73b9f1e7c9a",
    (7, 9, 16384): "15e90127a5124e97ab91e06b674c1a21b60b61104aec0720346883fe90284366",
    (20, 2000, 16384): "ad8a322a904cf19c4e6302fb84189ee20f094b07946dc3a64232bc877990ff9b",
    (30, 8000, 16384): "6af580a518d1611de209a6cad63b8d3e2aa08afb3d915120a67744843abc372c",
    (300, 300, 64): "c9eaf5041615686c9c0e511dff0de4a883173116d88af8bdb0c61df4a3c89a91",
    (299, 301, 100): "9cfa96a64a3f15952cd484b42b8220e06f02fc82a169aa6c1594115815724bab",
    (700, 90, 16384): "39f3d720d833e1d1314a777f0573fed3fd2f83f3c397e98f40cc522ab1caa492",
    (23, 6.0, 60, 90): "d8a3b71f60c834489c1d2423e211ef48c40429512500f49f7a1ebb14054d3b20",
    (3, 30.0, 40, 40): "233be5bb7334ff842c2512cd94c4be36f7c5b515955b55ef2b9a7c01c69debd9",
}


def gradient_image(h, w, seed=0):
  """A smooth gradient plus noise, so resampling errors show in every pixel."""
  rng = np.random.default_rng([seed, h, w])
  y, x = np.mgrid[0:h, 0:w]
  smooth = np.stack([255 * x / max(w - 1, 1), 255 * y / max(h - 1, 1), 127 + 100 * np.sin((x + y) / 7)], -1)
  return np.clip(smooth + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)


def gradient_video(t, h, w):
  return np.stack([gradient_image(h, w, seed=i) for i in range(t)])


def digest(pixel_values, grid) -> str:
  """Values map back to uint8 exactly: v = (x − 127.5) / 127.5."""
  pixels = np.rint(np.asarray(pixel_values, np.float64) * 127.5 + 127.5).astype(np.uint8)
  return hashlib.sha256(np.asarray(grid, np.int64).tobytes() + pixels.tobytes()).hexdigest()


def transformers_processors():
  try:
    import torchvision  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except (ImportError, RuntimeError) as e:
    pytest.skip(f"transformers' K2.5 processors need a working torchvision ({type(e).__name__}: {str(e)[:80]})")
  from transformers.models.kimi_k25 import image_processing_kimi_k25, video_processing_kimi_k25  # pylint: disable=import-outside-toplevel
  return image_processing_kimi_k25.Kimi_K25ImageProcessor(), video_processing_kimi_k25.Kimi_K25VideoProcessor()


# ------------------------------------------------------------------------------ resize kernel
@pytest.mark.parametrize("seed", range(3))
def test_resize_is_bit_exact_with_torch_uint8_bicubic(seed):
  rng = np.random.default_rng(seed)
  for _ in range(40):
    big_h, big_w = rng.integers(1, 200, 2)
    h, w = int(rng.integers(1, big_h + 1)), int(rng.integers(1, big_w + 1))
    image = rng.integers(0, 256, (big_h, big_w, 3), dtype=np.uint8)
    ref = torch.nn.functional.interpolate(torch.from_numpy(image).permute(2, 0, 1)[None], size=(h, w),
                                          mode="bicubic", antialias=True, align_corners=False)
    np.testing.assert_array_equal(vision.resize_bicubic(image, h, w), ref[0].permute(1, 2, 0).numpy(),
                                  err_msg=f"{(big_h, big_w)} -> {(h, w)}")


def test_navit_size_by_hand():
  # 1820² has 130² = 16900 patches > 16384: s = √(16384/16900) = 128/130 → 1792 (128² patches)
  assert vision.navit_size(1820, 1820) == ((1792, 1792), (1792, 1792))
  assert vision.navit_size(100, 150) == ((100, 150), (112, 168))          # never upscaled
  assert vision.navit_size(7, 9) == ((7, 9), (28, 28))
  assert vision.navit_size(30, 8000) == ((26, 7168), (28, 7168))          # ≤ 512 patches per side
  assert vision.navit_size(2000, 3000) == ((1468, 2202), (1484, 2212))    # 16748 patches after padding


# ------------------------------------------------------------------------------ vs transformers
@pytest.mark.parametrize("case", IMAGE_CASES)
def test_image_matches_transformers_processor(case):
  image_processor, _ = transformers_processors()
  h, w, max_patches = case
  image = gradient_image(h, w)
  ref = image_processor(Image.fromarray(image), max_patches=max_patches, return_tensors="np")
  ours = vision.preprocess_image(image, max_patches=max_patches)
  assert ours.grid_thw == tuple(ref["image_grid_thw"][0])
  np.testing.assert_allclose(ours.pixel_values, ref["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", VIDEO_CASES)
def test_video_matches_transformers_processor(case):
  _, video_processor = transformers_processors()
  t, fps, h, w = case
  frames = gradient_video(t, h, w)
  ref = video_processor(videos=[frames], video_metadata=[{"fps": fps, "total_num_frames": t}],
                        return_metadata=True, return_tensors="np")
  ours = vision.preprocess_video(frames, fps)
  assert [m.grid_thw for m in ours] == [tuple(g) for g in ref["video_grid_thw"]]
  np.testing.assert_allclose(np.concatenate([m.pixel_values for m in ours]), ref["pixel_values_videos"],
                             atol=1e-5, rtol=0)
  stamps = ref["video_metadata"][0].timestamps
  assert [vision.timestamp_text(m.timestamp) for m in ours] == [
      vision.timestamp_text(float(stamps[i])) for i in range(0, len(stamps), 4)]


def recorded_outputs():
  """Our digests for IMAGE_CASES and VIDEO_CASES, keyed like RECORDED."""
  out = {}
  for h, w, max_patches in IMAGE_CASES:
    media = vision.preprocess_image(gradient_image(h, w), max_patches=max_patches)
    out[(h, w, max_patches)] = digest(media.pixel_values, [media.grid_thw])
  for t, fps, h, w in VIDEO_CASES:
    chunks = vision.preprocess_video(gradient_video(t, h, w), fps)
    out[(t, fps, h, w)] = digest(np.concatenate([m.pixel_values for m in chunks]), [m.grid_thw for m in chunks])
  return out


def test_outputs_match_recorded_transformers_outputs():
  assert recorded_outputs() == RECORDED


# ------------------------------------------------------------------------------ bad input
def test_corrupt_and_empty_images_are_clear_errors(tmp_path):
  png = io.BytesIO()
  Image.fromarray(gradient_image(20, 20)).save(png, format="PNG")
  with pytest.raises(ValueError, match="image bytes: cannot decode"):
    vision.preprocess_image(png.getvalue()[:40])                  # truncated file
  (tmp_path / "x.jpg").write_bytes(b"not an image at all")
  with pytest.raises(ValueError, match="x.jpg.*cannot decode"):
    vision.preprocess_image(str(tmp_path / "x.jpg"))
  with pytest.raises(ValueError, match="zero size"):
    vision.preprocess_image(np.zeros((0, 12, 3), np.uint8))
  with pytest.raises(ValueError, match="zero size"):
    vision.preprocess_image(Image.new("RGB", (0, 5)))
  with pytest.raises(ValueError, match="uint8"):
    vision.preprocess_image(np.zeros((8, 8, 3), np.float32))
  with pytest.raises(ValueError, match="no frames"):
    vision.preprocess_video(np.zeros((0, 8, 8, 3), np.uint8), 30.0)


def test_decoded_png_equals_the_array_and_gray_becomes_rgb():
  image = gradient_image(30, 50)
  png = io.BytesIO()
  Image.fromarray(image).save(png, format="PNG")
  np.testing.assert_array_equal(vision.preprocess_image(png.getvalue()).pixel_values,
                                vision.preprocess_image(image).pixel_values)
  gray = vision.load_image(image[..., 0])
  assert gray.shape == (30, 50, 3) and (gray == image[..., :1]).all()


def test_transparency_is_composited_onto_white_as_transformers_does():
  from transformers.image_transforms import convert_to_rgb
  rng = np.random.default_rng(0)
  rgba = rng.integers(0, 256, (20, 30, 4), dtype=np.uint8)
  rgba[0, 0, 3], rgba[0, 1, 3] = 0, 255                       # fully transparent, fully opaque
  palette = Image.fromarray(rng.integers(0, 4, (20, 30), dtype=np.uint8), mode="P")
  palette.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 756)
  palette.info["transparency"] = 2
  png = io.BytesIO()
  Image.fromarray(rgba, "RGBA").save(png, format="PNG")
  cases = {"rgba array": rgba, "RGBA image": Image.fromarray(rgba, "RGBA"), "LA image": Image.fromarray(rgba[..., 2:], "LA"),
           "P with transparency": palette}
  for name, image in cases.items():
    ours, theirs = vision.load_image(image), convert_to_rgb(image, return_numpy=True)
    np.testing.assert_array_equal(ours, theirs, err_msg=name)
  assert (vision.load_image(rgba)[0, 0] == 255).all() and (vision.load_image(rgba)[0, 1] == rgba[0, 1, :3]).all()
  np.testing.assert_array_equal(vision.load_image(png.getvalue()), convert_to_rgb(Image.fromarray(rgba, "RGBA"),
                                                                                  return_numpy=True))


def test_video_shorter_than_a_chunk_keeps_its_frames():
  """Three frames at 2 fps: one chunk of t = 3 (no padding, no error), as transformers does."""
  chunks = vision.preprocess_video(gradient_video(3, 56, 84), 2.0)
  assert [m.grid_thw for m in chunks] == [(3, 4, 6)]
  assert chunks[0].num_tokens == 6                      # (4/2)·(6/2): frames are averaged by the merger


# ------------------------------------------------------------------------------ media tokens
def test_image_block_text_and_ids():
  media = vision.preprocess_image(gradient_image(56, 84))
  assert media.grid_thw == (1, 4, 6) and media.num_tokens == 6
  assert vision.media_text(media) == ("<|media_begin|>image<|media_content|>" + "<|media_pad|>" * 6
                                      + "<|media_end|>")
  tok = tokenizer.ByteTokenizer(media=True)
  ids = vision.media_token_ids(media, tok)
  assert ids == [259, *tok.encode("image"), 260, *[262] * 6, 261]
  assert tok.decode(ids) == vision.media_text(media)
  with pytest.raises(ValueError, match="media=True"):
    vision.media_token_ids(media, tokenizer.ByteTokenizer())


def test_video_chunks_are_stamped_blocks():
  chunks = vision.preprocess_video(gradient_video(12, 28, 28), 4.0)    # 6 frames sampled: chunks of 4 and 2
  assert [(m.grid_thw, m.timestamp) for m in chunks] == [((4, 2, 2), 0.0), ((2, 2, 2), 2.0)]
  assert vision.media_text(chunks[1]) == ("00:00:02.000<|media_begin|>video<|media_content|><|media_pad|>"
                                          "<|media_end|>")
  pixels, grid = vision.pack_media(chunks)
  assert pixels.shape == (24, 3, 14, 14) and grid == ((4, 2, 2), (2, 2, 2))


def transformers_outputs():
  """transformers' digests for IMAGE_CASES and VIDEO_CASES (needs torchvision)."""
  image_processor, video_processor = transformers_processors()
  out = {}
  for h, w, max_patches in IMAGE_CASES:
    ref = image_processor(Image.fromarray(gradient_image(h, w)), max_patches=max_patches, return_tensors="np")
    out[(h, w, max_patches)] = digest(ref["pixel_values"], ref["image_grid_thw"])
  for t, fps, h, w in VIDEO_CASES:
    ref = video_processor(videos=[gradient_video(t, h, w)], video_metadata=[{"fps": fps, "total_num_frames": t}],
                          return_tensors="np")
    out[(t, fps, h, w)] = digest(ref["pixel_values_videos"], ref["video_grid_thw"])
  return out


if __name__ == "__main__":
  for key, value in transformers_outputs().items():
    print(f"    {key}: \"{value}\",")
