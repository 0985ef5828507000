"""experiments/fusion_ablation.py's summary over seeds, against numbers worked by hand."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

import fusion_ablation  # noqa: E402


def run(seed: int, text_losses: tuple[float, float, float], count_accuracy: float = 0.25) -> dict:
  """One seed's result file: early, mid, late with these text losses, the other metrics equal."""
  def final(text_loss):
    return {"count_accuracy": count_accuracy, "count_answer_loss": 0.8, "caption_answer_loss": 0.5,
            "caption_token_accuracy": 0.9, "text_loss": text_loss}
  return {"args": {"seed": seed},
          "results": {name: {"final": final(loss)} for name, loss in zip(fusion_ablation.SETTINGS, text_losses)}}


def test_mean_and_standard_error_over_seeds_and_paired_differences():
  # text loss, early / mid / late per seed:
  #   seed 0: 2.0 / 2.2 / 2.9    seed 1: 2.2 / 2.3 / 3.0    seed 2: 2.4 / 2.7 / 3.1
  result = fusion_ablation.aggregate([run(0, (2.0, 2.2, 2.9)), run(1, (2.2, 2.3, 3.0)), run(2, (2.4, 2.7, 3.1))])
  assert result["seeds"] == [0, 1, 2]
  # early: mean 2.2, sample sd 0.2, s.e. 0.2 / √3
  mean, error = result["settings"]["early 10:90"]["text_loss"]
  assert mean == pytest.approx(2.2) and error == pytest.approx(0.2 / np.sqrt(3))
  # early − mid per seed: −0.2, −0.1, −0.3: mean −0.2, sd 0.1, s.e. 0.0577; |−0.2| > 2 × 0.0577: early better
  pair = result["pairs"]["early 10:90 vs mid 20:80: text_loss"]
  assert pair["mean"] == pytest.approx(-0.2) and pair["error"] == pytest.approx(0.1 / np.sqrt(3))
  assert pair["exceeds_noise"] and pair["better"] == "early 10:90"
  # mid − late: −0.7, −0.7, −0.4: mean −0.6, sd 0.1732, s.e. 0.1: |−0.6| > 0.2, mid better
  pair = result["pairs"]["mid 20:80 vs late 50:50: text_loss"]
  assert pair["mean"] == pytest.approx(-0.6) and pair["error"] == pytest.approx(0.1)
  assert pair["exceeds_noise"] and pair["better"] == "mid 20:80"
  # equal metrics on every seed: a zero difference, inside the noise, neither better
  pair = result["pairs"]["early 10:90 vs late 50:50: count_accuracy"]
  assert pair["mean"] == 0 and not pair["exceeds_noise"] and pair["better"] == "neither"
  assert "* early 10:90 vs mid 20:80: text_loss" in fusion_ablation.aggregate_table(result)


def test_a_difference_inside_two_standard_errors_is_noise():
  # count accuracy, higher is better; early − mid per seed: +0.1, −0.1 (mean 0, s.e. 0.1), then +0.2, 0.0
  runs = [run(0, (2.0, 2.0, 2.0), 0.3), run(1, (2.0, 2.0, 2.0), 0.1)]
  runs[0]["results"]["mid 20:80"]["final"]["count_accuracy"] = 0.2
  runs[1]["results"]["mid 20:80"]["final"]["count_accuracy"] = 0.2
  pair = fusion_ablation.aggregate(runs)["pairs"]["early 10:90 vs mid 20:80: count_accuracy"]
  assert pair["mean"] == pytest.approx(0.0) and pair["error"] == pytest.approx(0.1) and not pair["exceeds_noise"]
  runs[1]["results"]["early 10:90"]["final"]["count_accuracy"] = 0.2
  pair = fusion_ablation.aggregate(runs)["pairs"]["early 10:90 vs mid 20:80: count_accuracy"]
  # +0.1, 0.0: mean 0.05, sd 0.0707, s.e. 0.05: |0.05| = 1 s.e., noise; early ahead on the mean
  assert pair["mean"] == pytest.approx(0.05) and pair["error"] == pytest.approx(0.05)
  assert not pair["exceeds_noise"] and pair["better"] == "early 10:90"


def test_the_summary_plot_has_a_panel_a_metric(tmp_path):
  result = fusion_ablation.aggregate([run(0, (2.0, 2.2, 2.9)), run(1, (2.2, 2.3, 3.0))])
  fusion_ablation.plot_aggregate(result, str(tmp_path / "summary.png"))
  from PIL import Image
  with Image.open(tmp_path / "summary.png") as image:
    width, height = image.size
  assert width > 3 * height     # five panels side by side
