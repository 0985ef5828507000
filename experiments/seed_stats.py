"""Statistics over seeds for the experiments: the mean and its standard error, and the paired
difference of two settings run with the same seeds."""
from __future__ import annotations

import numpy as np


def mean_and_error(values) -> tuple[float, float]:
  """(mean, standard error s / √n with s the sample standard deviation) of per-seed values;
  the error is NaN for one seed."""
  values = np.asarray(values, np.float64)
  return float(values.mean()), float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else float("nan")


def paired_difference(a, b, higher_is_better: bool, names: tuple[str, str]) -> dict:
  """The per-seed difference a − b: mean ± s.e., whether it exceeds the noise (|mean| > 2 s.e.)
  and which of `names` (a's, b's) is better on average ("neither" at a zero mean)."""
  mean, error = mean_and_error(np.subtract(a, b))
  better = names[0] if (mean > 0) == higher_is_better else names[1]
  return dict(mean=mean, error=error, exceeds_noise=bool(abs(mean) > 2 * error), better=better if mean else "neither")
