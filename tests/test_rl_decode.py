"""The batched decode's padding: bucket shapes and right-padded rows."""
import numpy as np
import pytest

from k25jax.model import config
from k25jax.rl import decode, sampler

CFG = config.preset("tiny", max_position_embeddings=64)


def test_buckets_are_the_next_power_of_two():
  assert [decode.bucket(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
  assert [decode.bucket(n, 16) for n in (1, 16, 17, 33, 538)] == [16, 16, 32, 64, 1024]


def test_pad_rounds_width_and_rows_to_buckets_and_caps_width_at_the_context():
  sampling = sampler.SamplingConfig(max_new_tokens=8, pad_id=0)
  contexts = [[1] * 10] * 17 + [[2] * 3]
  prompts, lengths = decode.pad(contexts, CFG, sampling, min_width=16, min_rows=16)
  assert prompts.shape == (32, 16)
  assert lengths.tolist() == [10] * 17 + [3] + [1] * 14                  # padding rows: one pad token
  assert np.all(prompts[17, 3:] == 0) and np.all(prompts[:17, :10] == 1)
  wide, _ = decode.pad([[1] * 50], CFG, sampling, min_width=16)          # bucket 64 > 64 − 8 positions
  assert wide.shape == (1, 56)
  multiple, _ = decode.pad(contexts, CFG, sampling, width_multiple=24, bucket_rows=False)
  assert multiple.shape == (18, 24)
  with pytest.raises(ValueError, match="leaves no room for 8 new ones"):
    decode.pad([[1] * 57], CFG, sampling, min_width=16)


def test_a_wide_call_is_padded_to_fewer_rows():
  """min_tokens: at least min(min_rows, min_tokens // width) rows, so 2 contexts of 1,000 ids
  are decoded in 4 rows, not 16; narrow calls keep min_rows."""
  sampling = sampler.SamplingConfig(max_new_tokens=8, pad_id=0)
  cfg = config.preset("tiny", max_position_embeddings=2048)
  shapes = {width: decode.pad([[1] * width] * 2, cfg, sampling, min_width=16, min_rows=16, min_tokens=4096)[0].shape
            for width in (40, 256, 300, 1000, 2000)}
  assert shapes == {40: (16, 64), 256: (16, 256), 300: (8, 512), 1000: (4, 1024), 2000: (2, 2040)}
  assert decode.pad([[1] * 1000] * 5, cfg, sampling, min_width=16, min_rows=16, min_tokens=4096)[0].shape == (8, 1024)
