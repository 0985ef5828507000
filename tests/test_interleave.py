"""experiments/interleave.py: the page faults it records beside the step times."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

import interleave  # noqa: E402


def test_minor_page_faults_count_fresh_pages_not_reused_ones():
  """A call that writes 64 MiB of freshly mapped memory faults its pages in (16,384 of 4 KiB, or far
  fewer huge pages); writing into memory already touched faults nothing."""
  kept = np.ones(1 << 20, np.float32)

  def fresh():
    np.ones(64 << 18, np.float32)                     # 64 MiB: above glibc's mmap threshold, mapped anew

  def reused():
    kept.fill(2.0)

  faults = interleave.minor_page_faults({"fresh": fresh, "reused": reused})
  assert faults["fresh"] >= 16
  assert faults["reused"] < faults["fresh"]
  assert faults["reused"] < 16
