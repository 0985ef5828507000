"""The joint vision–text mixture: vision share by tokens, schedules, packing, exact resume."""
import numpy as np
import pytest

from k25jax.data import mixture, sources, tokenizer, visual_synthetic

TOK = tokenizer.ByteTokenizer(media=True)


@pytest.fixture(scope="module")
def docs():
  return sources.split(sources.load("python_stdlib", 1000), 50)[0]


def make(docs, schedule, *, total_steps=100, batch=8, seq_len=128, max_patches=1024, tasks=visual_synthetic.TASKS):
  return mixture.mixture(docs=docs, tok=TOK, schedule=schedule, tasks=tasks, batch=batch, seq_len=seq_len,
                         total_steps=total_steps, seed=0, max_patches=max_patches)


@pytest.mark.parametrize("ratio", [0.1, 0.5])
def test_vision_share_over_100_batches_is_within_two_points(docs, ratio):
  shares = [b["is_vision"].mean() for b, _ in zip(make(docs, mixture.VisionSchedule(ratio)), range(100))]
  assert abs(np.mean(shares) - ratio) < 0.02, np.mean(shares)
  assert abs(np.mean(shares[:10]) - ratio) < 0.02      # already from the start (error diffusion)


def test_rows_are_full_and_placeholders_match_the_media(docs):
  it = make(docs, mixture.VisionSchedule(0.2))
  for _ in range(5):
    b = next(it)
    assert (b["segment_ids"] > 0).all()                 # text fills every position
    placeholders = int((b["inputs"] == TOK.media.pad).sum())
    assert placeholders == sum(m.num_tokens for m in b["media"]) > 0
    assert sum(m.pixel_values.shape[0] for m in b["media"]) <= 1024


def test_vision_loss_covers_answers_only(docs):
  b = next(make(docs, mixture.VisionSchedule(1.0), tasks=("count",)))
  row_inputs, row_targets = b["inputs"][0], b["targets"][0]
  scored = (b["loss_mask"][0] > 0) & (b["is_vision"][0] > 0)
  answers = TOK.decode(row_targets[scored])
  # every scored target is a digit 1–4 followed by EOS (which decodes to nothing)
  assert answers and set(answers) <= set("1234")
  assert int((row_targets[scored] == TOK.eos_id).sum()) == int((row_inputs == TOK.bos_id).sum())


def test_late_start_and_ramp_schedules(docs):
  late = make(docs, mixture.VisionSchedule(0.5, "constant", start=0.8), total_steps=10)
  media = [len(b["media"]) for b, _ in zip(late, range(10))]
  assert media[:8] == [0] * 8 and min(media[8:]) > 0
  ramp = mixture.VisionSchedule(0.4, "ramp", start=0.5)
  assert [ramp.ratio_at(t, 10) for t in (4, 5, 7, 10)] == [0.0, 0.0, pytest.approx(0.16), 0.4]
  assert ramp.overall_share == pytest.approx(0.1)
  assert mixture.VisionSchedule(0.2, start=0.5).overall_share == pytest.approx(0.1)


def test_resume_from_state_is_exact(docs):
  a = make(docs, mixture.VisionSchedule(0.3))
  for _ in range(3):
    next(a)
  state = a.get_state()
  b = make(docs, mixture.VisionSchedule(0.3))
  b.set_state(state)
  for _ in range(2):
    x, y = next(a), next(b)
    for name in mixture.FEATURES:
      np.testing.assert_array_equal(x[name], y[name])
    for m, n in zip(x["media"], y["media"], strict=True):
      np.testing.assert_array_equal(m.pixel_values, n.pixel_values)


def test_bad_settings_are_clear_errors(docs):
  with pytest.raises(ValueError, match="vision_ratio"):
    mixture.VisionSchedule(1.5)
  with pytest.raises(ValueError, match="vision_schedule"):
    mixture.VisionSchedule(0.1, "cosine")
  with pytest.raises(ValueError, match="train.seq_len"):
    next(make(docs, mixture.VisionSchedule(0.5), seq_len=16))
  with pytest.raises(ValueError, match="data.max_patches"):
    next(make(docs, mixture.VisionSchedule(0.5), max_patches=8))
  with pytest.raises(ValueError, match="needs a text source"):
    make(None, mixture.VisionSchedule(0.5))
