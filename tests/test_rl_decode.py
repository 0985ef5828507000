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
