"""experiments/bench_device.py's flop count and peak table (the timed run needs an accelerator)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

import bench_device  # noqa: E402
from k25jax.model import config as model_config  # noqa: E402


def test_step_flops_by_hand():
  cfg = model_config.preset("tiny")
  b, s = 2, 8
  n = model_config.param_counts(cfg)["active"] - cfg.vocab_size * cfg.hidden_size
  attention = 3 * cfg.num_hidden_layers * 2 * b * cfg.num_attention_heads * (s * (s + 1) // 2) * (
      cfg.qk_head_dim + cfg.v_head_dim)
  flops = bench_device.step_flops(cfg, b, s)
  assert flops["dense"] == 6 * n * b * s
  assert flops["attention"] == pytest.approx(attention)
  assert flops["total"] == pytest.approx(6 * n * b * s + attention)


def test_peak_lookup():
  assert bench_device.peak_flops("NVIDIA H200", None) == 989e12
  assert bench_device.peak_flops("TPU v5 lite", None) == 197e12
  assert bench_device.peak_flops("TPU v5p", None) == 459e12
  assert bench_device.peak_flops("cpu", None) is None
  assert bench_device.peak_flops("cpu", 1.5) == 1.5e12
