"""experiments/interleave.py: the page faults it records beside the step times."""
import mmap
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

import interleave  # noqa: E402


def test_minor_page_faults_count_fresh_pages_not_reused_ones():
  """A call that writes 64 MiB of freshly mapped memory faults its pages in (16,384 of 4 KiB, or far
  fewer huge pages); writing into memory already touched faults nothing. The fresh memory is an
  anonymous mmap of its own: a numpy array that size may come from malloc's heap, which in a
  long-lived test worker can hold 64 MiB already touched by an earlier test."""
  kept = np.ones(1 << 20, np.float32)

  def fresh():
    pages = mmap.mmap(-1, 64 << 20)
    np.frombuffer(pages, np.float32).fill(1.0)
    pages.close()

  def reused():
    kept.fill(2.0)

  faults = interleave.minor_page_faults({"fresh": fresh, "reused": reused})
  assert faults["fresh"] >= 16
  assert faults["reused"] < faults["fresh"]
  assert faults["reused"] < 16
