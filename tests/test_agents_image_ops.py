"""k25jax.agents.image_ops: each operation on hand-built images; components against SciPy."""
import numpy as np
import pytest
from scipy import ndimage

from k25jax.agents import image_ops as ops

RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def canvas(height=6, width=8, fill=(0, 0, 0)):
  img = np.zeros((height, width, 3), np.uint8)
  img[:] = fill
  return img


def two_red_one_blue():
  """A black 6x8 image: a red 2x2 square at rows 0-1 / cols 0-1, a red L at rows 3-5 /
  cols 5-6 (4 pixels), a blue bar at row 5, cols 0-2."""
  img = canvas()
  img[0:2, 0:2] = RED
  img[3:6, 5] = RED
  img[5, 6] = RED
  img[5, 0:3] = BLUE
  return img


def test_binarize_is_strictly_above_the_mean_of_the_channels():
  img = canvas(1, 3)
  img[0, 0] = (90, 90, 90)     # brightness 90
  img[0, 1] = (255, 0, 15)     # brightness 90
  img[0, 2] = (91, 91, 91)     # brightness 91
  np.testing.assert_array_equal(ops.binarize(img, 90), [[False, False, True]])
  np.testing.assert_array_equal(ops.binarize(img[..., 0], 90), [[False, True, True]])   # grey input


def test_colour_mask_uses_the_chebyshev_tolerance():
  img = canvas(1, 4)
  img[0] = [(255, 0, 0), (215, 40, 40), (214, 0, 0), (255, 0, 41)]
  np.testing.assert_array_equal(ops.colour_mask(img, "red"), [[True, True, False, False]])
  np.testing.assert_array_equal(ops.colour_mask(img, (255, 0, 0), tol=0), [[True, False, False, False]])
  assert ops.count_pixels(img, "red", tol=41) == 4


def test_count_pixels_and_objects():
  img = two_red_one_blue()
  assert ops.count_pixels(img, "red") == 8
  assert ops.count_pixels(img, "blue") == 3
  assert ops.count_pixels(img, "black") == 48 - 11
  assert ops.count_objects(img, "red") == 2
  assert ops.count_objects(img, "red", min_pixels=5) == 0
  assert ops.count_objects(img, "green") == 0


def test_connected_components_are_four_connected_in_raster_order():
  mask = np.array([
      [0, 1, 0, 0, 1],
      [1, 0, 0, 1, 1],   # (0,1) and (1,0) touch only diagonally: two components
      [0, 0, 1, 0, 0],
      [1, 1, 1, 0, 1],
  ], bool)
  labels, n = ops.connected_components(mask)
  assert n == 5
  np.testing.assert_array_equal(labels, [
      [0, 1, 0, 0, 2],
      [3, 0, 0, 2, 2],
      [0, 0, 4, 0, 0],
      [4, 4, 4, 0, 5],
  ])


def test_a_u_shape_merges_runs_found_apart():
  mask = np.array([
      [1, 0, 1, 0, 1],
      [1, 0, 1, 0, 1],
      [1, 1, 1, 1, 1],
  ], bool)
  labels, n = ops.connected_components(mask)
  assert n == 1 and (labels == 1).sum() == mask.sum()


@pytest.mark.parametrize("seed, density", [(0, 0.3), (1, 0.5), (2, 0.6), (3, 0.05)])
def test_connected_components_match_scipy(seed, density):
  mask = np.random.default_rng(seed).random((37, 53)) < density
  labels, n = ops.connected_components(mask)
  expected, expected_n = ndimage.label(mask)   # 4-connectivity, raster order by default
  assert n == expected_n
  np.testing.assert_array_equal(labels, expected)


def test_empty_and_full_masks():
  labels, n = ops.connected_components(np.zeros((3, 4), bool))
  assert n == 0 and not labels.any()
  labels, n = ops.connected_components(np.ones((3, 4), bool))
  assert n == 1 and (labels == 1).all()
  assert ops.bounding_boxes(np.ones((3, 4), bool)) == [(0, 0, 3, 4)]


def test_bounding_boxes_are_half_open_per_object():
  img = two_red_one_blue()
  assert ops.bounding_boxes(ops.colour_mask(img, "red")) == [(0, 0, 2, 2), (3, 5, 6, 7)]
  assert ops.bounding_boxes(ops.colour_mask(img, "blue")) == [(5, 0, 6, 3)]


def test_find_objects_and_locate():
  img = two_red_one_blue()
  square, ell = ops.find_objects(img, "red")
  assert square == {"pixels": 4, "box": (0, 0, 2, 2), "centroid": (0.5, 0.5)}
  assert ell == {"pixels": 4, "box": (3, 5, 6, 7), "centroid": (4.25, 5.25)}
  assert ops.locate(img, "blue") == {"pixels": 3, "box": (5, 0, 6, 3), "centroid": (5.0, 1.0)}
  everything_red = ops.locate(img, "red")
  assert everything_red["box"] == (0, 0, 6, 7) and everything_red["centroid"] == (2.375, 2.875)
  assert ops.locate(img, "green") is None


def test_crop_is_a_copy_of_the_slice():
  img = two_red_one_blue()
  piece = ops.crop(img, (3, 5, 6, 7))
  np.testing.assert_array_equal(piece, img[3:6, 5:7])
  piece[:] = 7
  assert img[3, 5].tolist() == list(RED)


def test_compare_regions_brightness_and_colour():
  img = canvas(2, 4)
  img[:, 0:2] = WHITE                    # left half white (255)
  img[0, 2] = RED                        # right half: one red pixel (85), three black
  result = ops.compare_regions(img, (0, 0, 2, 2), (0, 2, 2, 4), colour="red")
  assert result == {"brightness_a": 255.0, "brightness_b": 21.25, "brightness_diff": 233.75,
                    "brighter": "a", "pixels_a": 0, "pixels_b": 1, "more": "b"}
  same = ops.compare_regions(img, (0, 0, 1, 1), (1, 1, 2, 2))
  assert same["brighter"] == "equal" and "more" not in same


@pytest.mark.parametrize("call, message", [
    (lambda img: ops.count_pixels(img, "chartreuse"), "not in the palette"),
    (lambda img: ops.count_pixels(img, (300, 0, 0)), "triple of ints"),
    (lambda img: ops.count_pixels(img.astype(np.float32), "red"), "dtype uint8"),
    (lambda img: ops.count_pixels(img[..., 0], "red"), "img must be a uint8 image"),
    (lambda img: ops.crop(img, (0, 0, 7, 2)), "outside the image"),
    (lambda img: ops.crop(img, (2, 2, 2, 4)), "is empty"),
    (lambda img: ops.crop(img, (0, 0, 2)), "must be (y0, x0, y1, x1)"),
    (lambda img: ops.compare_regions(img, (0, 0, 1, 1), (0, 0, 9, 9)), "box_b"),
    (lambda img: ops.connected_components(img[..., 0]), "must be a bool array"),
    (lambda img: ops.binarize(img, 300), "threshold"),
])
def test_bad_input_names_the_argument(call, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    call(two_red_one_blue())
