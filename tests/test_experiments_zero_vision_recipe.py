"""experiments/zero_vision_recipe.py's report over seeds (Fig. 2 on the recipe's base), against
numbers worked by hand."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

import zero_vision_recipe  # noqa: E402


def arm_run(sft: tuple[float, float] | None, accuracies: tuple[float, ...], tool_call_success: float) -> dict:
  """One arm at one seed: its SFT evaluation (accuracy, tool-call success) and RL's eval rows."""
  evals = [{"iteration": 10 * i, "accuracy": a, "tool_call_success": tool_call_success}
           for i, a in enumerate(accuracies)]
  return {"sft": None if sft is None else {"accuracy": sft[0], "tool_call_success": sft[1]}, "evals": evals,
          "rl_minutes": 1.0}


def runs(zero_vision_final: tuple[float, float, float]) -> dict:
  """Three seeds: zero-vision ends RL at `zero_vision_final`, text+vision at 0.30, 0.34, 0.32."""
  return {"zero_vision": {s: arm_run((0.3, 0.5), (0.25, f), 0.8) for s, f in enumerate(zero_vision_final)},
          "text_vision": {s: arm_run((0.3, float("nan")), (0.3, f), float("nan"))
                          for s, f in enumerate((0.30, 0.34, 0.32))},
          "no_sft": {s: arm_run(None, (0.0, 0.0), float("nan")) for s in range(3)}}


def test_the_summary_over_seeds_and_the_claims_verdict():
  summary = zero_vision_recipe.summarize(runs((0.90, 0.70, 0.80)))
  assert summary["seeds"] == [0, 1, 2]
  # zero-vision final accuracy 0.9, 0.7, 0.8: mean 0.8, sample sd 0.1, s.e. 0.1 / √3
  mean, error = summary["arms"]["zero_vision"]["mean_and_error"]["rl_final_accuracy"]
  assert mean == pytest.approx(0.8) and error == pytest.approx(0.1 / np.sqrt(3))
  # no SFT arm: no SFT metrics, only RL's
  assert "sft_accuracy" not in summary["arms"]["no_sft"]["mean_and_error"]
  # zero-vision − text+vision per seed: 0.60, 0.36, 0.48: mean 0.48, sd 0.12, s.e. 0.0693 — beyond 2 s.e.
  pair = summary["pairs"]["zero_vision vs text_vision"]
  assert pair["mean"] == pytest.approx(0.48) and pair["error"] == pytest.approx(0.12 / np.sqrt(3))
  assert pair["exceeds_noise"] and pair["better"] == "zero_vision"
  assert summary["verdict"].startswith("reproduced at this scale")
  text = zero_vision_recipe.table(summary)
  assert "| no_sft | – | – | 0.000 ± 0.000 | 0.000 ± 0.000 |" in text and "+0.480 ± 0.069" in text


def test_the_verdict_is_noise_within_two_standard_errors_and_refuted_beyond():
  # zero-vision − text+vision: 0.10, −0.14, 0.08: mean 0.0133, s.e. 0.0769 — noise
  assert zero_vision_recipe.summarize(runs((0.40, 0.20, 0.40)))["verdict"].startswith("not distinguishable")
  # −0.20, −0.24, −0.22: text+vision better beyond the noise
  assert zero_vision_recipe.summarize(runs((0.10, 0.10, 0.10)))["verdict"].startswith("refuted at this scale")


def test_set_overrides_go_to_their_stage_and_an_unknown_stage_is_an_error():
  base, rest = zero_vision_recipe.split_overrides(["midtrain.train.steps=5", "sft.train.steps=7", "rl.train.steps=3"])
  assert base == ("midtrain.train.steps=5",) and rest == {"sft": ["train.steps=7"], "rl": ["train.steps=3"]}
  with pytest.raises(ValueError, match="the stage is one of"):
    zero_vision_recipe.split_overrides(["parl.train.steps=3"])
