"""The generative reward model: verdicts parsed, judgements aggregated, agreement measured
against hand-computed numbers; the judge decodes every response's samples in one batch."""
import re

import jax
import ml_collections
import numpy as np
import pytest
from config_files import load_config
from scipy import stats

from configs import common
from k25jax.data import chat, descriptions, judgements, tokenizer, vision
from k25jax.model import k25
from k25jax.rl import decode, grm
from k25jax.train import config_utils, saved_model

PATTERN = re.compile(common.grm_section().verdict)


@pytest.mark.parametrize("text, value", [
    ("wrong: count 3.\nScore: 7/10", 0.7), ("correct.\nScore: 10/10  ", 1.0), ("Score:0/10", 0.0),
    ("Score: 7/10 then more", None), ("Score: 11/10", None), ("no verdict", None), ("", None), (None, None)])
def test_the_verdict_ends_the_judgement(text, value):
  got = grm.parse_verdict(text, PATTERN, 10)
  assert got == (None if value is None else pytest.approx(value))


def test_a_verdict_pattern_of_the_users_whose_group_is_no_number_does_not_parse():
  assert grm.parse_verdict("Verdict: good", re.compile(r"Verdict: (\w+)$"), 10) is None
  assert grm.parse_verdict("Verdict: 3", re.compile(r"Verdict: (\w+)$"), 5) == pytest.approx(0.6)


def test_samples_are_averaged_or_voted_unparsable_as_zero():
  v = np.array([[0.5, 0.5, np.nan, 0.9], [0.1, 0.9, np.nan, np.nan], [0.2, 0.4, 0.4, 0.2]])
  np.testing.assert_allclose(grm.aggregate(v, "mean"), [(0.5 + 0.5 + 0.9) / 4, 1.0 / 4, 0.3])
  np.testing.assert_allclose(grm.aggregate(v, "vote"), [0.5, 0.0, 0.3])   # a tie: the tied scores' mean


def test_agreement_against_hand_numbers_and_scipy():
  truth = np.array([1.0, 0.6, 0.2, 0.0, 0.55])
  rewards = np.array([0.9, 0.6, 0.4, 0.0, 0.5])
  judged = grm.Judgements(rewards, np.c_[rewards, [np.nan] * 5], [], 5, 1.0, 100)
  got = grm.agreement(judged, truth)
  assert got["spearman"] == pytest.approx(stats.spearmanr(rewards, truth).statistic)
  assert got["score_accuracy"] == pytest.approx(2 / 5)       # scores 9/10, 6/6, 4/2, 0/0, 5/6 (0.55 rounds up)
  assert got["within_one"] == pytest.approx(4 / 5)
  assert got["mae"] == pytest.approx(np.mean([0.1, 0, 0.2, 0, 0.05]))
  assert got["unparsable_rate"] == 0.5
  assert grm.spearman(np.ones(3), np.arange(3)) == 0.0


@pytest.mark.parametrize("field, value, message", [
    ("samples", 0, "grm.samples"), ("aggregate", "median", "grm.aggregate"), ("verdict", "Score: \\d+", "one group"),
    ("verdict", "Score: (", "not a regular expression"), ("max_score", 0, "grm.max_score")])
def test_bad_sections_name_their_field(field, value, message):
  section = common.grm_section(**{field: value})
  with pytest.raises(ValueError, match=re.escape(message)):
    grm.check(section)


def _tiny_judge():
  config = load_config("configs/grm.py", "test")
  tok = tokenizer.ByteTokenizer(media=True, chat=True)
  cfg = config_utils.k25_config_from(config.model, tok)
  return saved_model.SavedModel(cfg, k25.init_params(cfg, jax.random.PRNGKey(0)), tok, "workdir")


def test_every_response_and_sample_goes_through_one_decode_on_the_mesh_with_its_image(monkeypatch):
  """The judge's real decode (prefill with the images, params replicated on the run's mesh),
  its generated tokens then replaced by scripted judgements, parsed and aggregated."""
  saved = _tiny_judge()
  tasks = descriptions.make_tasks(4, seed=0)
  media = [vision.preprocess_image(t.image) for t in tasks]
  verdicts = ["correct.\nScore: 10/10", "wrong: count 3.\nScore: 4/10", "no verdict"]
  calls = []
  real_decode = decode.decode

  def scripted(cfg, params, contexts, rng, sampling, **kwargs):
    out = real_decode(cfg, params, contexts, rng, sampling, **kwargs)
    calls.append((contexts, out))
    n = len(contexts)
    tokens = np.zeros((n, sampling.max_new_tokens), np.int32)
    lengths = np.zeros(n, np.int32)
    for row in range(n):
      ids = saved.tokenizer.encode(verdicts[row // 2]) + [saved.tokenizer.special[chat.IM_END]]
      tokens[row, :len(ids)], lengths[row] = ids, len(ids)
    return {**out, "tokens": tokens, "lengths": lengths}

  monkeypatch.setattr(grm.decode, "decode", scripted)
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  judge = grm.Judge(saved, common.grm_section(samples=2, max_new_tokens=32), mesh)
  assert judge.params["language_model"]["embed_tokens"]["embedding"].sharding.mesh.size == len(jax.devices())
  got = judge.judge([t.question for t in tasks], ["1 object: red circle top left", None, "x", "y" * 500], media)
  (contexts, out), = calls
  assert len(contexts) == 6 and out["lengths"].min() > 0        # 3 responses x 2 samples, one batch
  assert got.too_long == 1 and got.texts[3] == [None, None]     # 500 bytes leave no room to judge: not decoded
  expected = chat.render_ids(saved.tokenizer, judgements.messages(tasks[1].question, "", media[1].num_tokens),
                             add_generation_prompt=True)[0]
  assert contexts[2] == contexts[3] == expected                 # None judged as an empty response
  np.testing.assert_allclose(got.rewards, [1.0, 0.4, 0.0, 0.0])
  assert got.unparsable == 4 and got.verdicts.shape == (4, 2) and got.texts[1] == [verdicts[1]] * 2


def test_the_judge_must_read_images_in_the_k25_format():
  saved = _tiny_judge()
  from k25jax.data import legacy_chat
  with pytest.raises(ValueError, match="K2.5 chat format|Kimi K2.5"):
    grm.Judge(saved_model.SavedModel(saved.cfg, saved.params, legacy_chat.ChatTokenizer(), "workdir"),
              ml_collections.ConfigDict(common.grm_section().to_dict()))
