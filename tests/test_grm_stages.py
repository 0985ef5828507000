"""The GRM through the stages: configs/grm.py trains a judge (SFT on judgement chats, then its
agreement with the hidden rubric), and joint RL rewards descriptions with that judge beside
the rule-rewarded tasks."""
import json

import ml_collections
import numpy as np
import pytest
from config_files import load_config
from test_stage_rl_vision import _small, _start

from k25jax.data import descriptions, vision
from k25jax.rl import grm
from k25jax.stages import rl_vision, sft
from k25jax.train import hf_export


class _Judge:
  """Scores each description by a fixed rule (its length), as a grm.Judge's `judge` returns."""

  def judge(self, questions, responses, media, references=None):
    rewards = np.array([min(len(r or ""), 10) / 10 for r in responses])
    return grm.Judgements(rewards, rewards[:, None], [], 0, 0.5, 7)


def test_descriptions_take_the_judges_reward_or_the_rubric_and_log_both():
  config = load_config("configs/rl.py", "joint,describe")
  made = rl_vision.make_tasks(4, 0, ("count", "describe"), 56)
  split = rl_vision.TaskSplit.of(made)

  class Episode:
    def __init__(self, answer):
      self.answer = answer
  episodes = [Episode("2"), Episode("1 object: red circle top left"), Episode("3"), Episode(made[3].answer)]
  rule = np.array([t.reward(e.answer) for t, e in zip(made, episodes)], np.float32)
  reward, logged = rl_vision.describe_rewards(config, _Judge(), split, episodes, rule)
  np.testing.assert_allclose(reward[[0, 2]], rule[[0, 2]])      # the counting tasks keep their rule
  np.testing.assert_allclose(reward[[1, 3]], [1.0, 1.0])         # the judge's verdicts
  assert logged["visual_description/gap"] == pytest.approx(np.mean([1.0 - rule[1], 0.0]))
  assert logged["grm_s"] == 0.5 and logged["grm_unparsable"] == 0.0
  config.rl.describe_reward = "rubric"
  reward, logged = rl_vision.describe_rewards(config, _Judge(), split, episodes, rule)
  np.testing.assert_allclose(reward, rule)
  assert "visual_description/grm_reward" in logged


def test_a_describe_run_needs_a_judge_or_the_rubric():
  config = load_config("configs/rl.py", "joint,describe")
  config.grm.checkpoint = ""
  with pytest.raises(ValueError, match="grm.checkpoint"):
    rl_vision.check_describe(config)
  config.rl.describe_reward = "rubric"
  rl_vision.check_describe(config)
  config.rl.describe_reward = "judge"
  with pytest.raises(ValueError, match="rl.describe_reward='judge'"):
    rl_vision.check_describe(config)


@pytest.mark.slow
def test_a_judge_trained_here_rewards_descriptions_in_joint_rl(tmp_path):
  judge = load_config("configs/grm.py", "test")
  judge.mesh.devices = 1          # the judge's training on one device; it judges on the RL run's 8
  _, history = sft.run(judge, str(tmp_path / "judge"))
  with open(tmp_path / "judge" / "sft_eval.json") as f:
    results = json.load(f)
  assert results["end"]["loss"] < results["start"]["loss"]
  assert set(results["judge"]) == {"greedy", "samples_1"}
  for row in results["judge"].values():
    assert -1 <= row["spearman"] <= 1 and 0 <= row["unparsable_rate"] <= 1 and row["judge_tokens"] > 0
  assert any(h["split"] == "eval/judge_greedy" for h in history)
  # the judge as its Hugging Face export: the same prompts and, greedy, the same judgements
  hf_export.export(str(tmp_path / "judge"), str(tmp_path / "judge_hf"))
  tasks = descriptions.make_tasks(2, seed=5)
  media = [vision.preprocess_image(t.image) for t in tasks]
  greedy = dict(judge.grm.to_dict(), samples=1, temperature=0.0)
  judges = [grm.Judge.load(ml_collections.ConfigDict(dict(greedy, checkpoint=str(tmp_path / where))))
            for where in ("judge", "judge_hf")]
  assert [j.prompt(tasks[0].question, "1 object: red circle top left", media[0]) for j in judges] == \
      [judges[0].prompt(tasks[0].question, "1 object: red circle top left", media[0])] * 2
  got = [j.judge([t.question for t in tasks], [t.answer for t in tasks], media) for j in judges]
  assert got[0].tokens == got[1].tokens and got[0].unparsable == got[1].unparsable
  np.testing.assert_array_equal(got[0].verdicts, got[1].verdicts)

  config = _small(load_config("configs/rl.py", "joint,describe"))
  config.task.kinds = "describe,count"     # iteration 0 draws tasks 12 and 10: descriptions
  config.rl.update(num_generations=4, prompts_per_iteration=2)
  config.train.update(steps=1, eval_every=1, checkpoint_every=1)
  config.grm.update(checkpoint=str(tmp_path / "judge"), samples=2, max_new_tokens=16)
  config.init.checkpoint = _start(config, tmp_path)
  _, history = rl_vision.run(config, str(tmp_path / "rl"))
  train = [h for h in history if h["split"] == "train"]
  described = [h for h in train if "visual_description/grm_reward" in h]
  assert described, "no iteration drew a description task"
  for h in described:
    assert 0 <= h["visual_description/grm_reward"] <= 1 and 0 <= h["visual_description/rubric"] <= 1
    assert h["visual_description/gap"] == pytest.approx(h["visual_description/grm_reward"]
                                                         - h["visual_description/rubric"])
    assert h["grm_s"] > 0 and h["grm_tokens"] > 0 and np.isfinite(h["loss"])
  evals = [h for h in history if h["split"] == "eval"]
  assert all(0 <= h["visual_description/rubric"] <= 1 for h in evals)
  assert descriptions.KIND in rl_vision.parse_kinds(config.task.kinds)
