"""Loads a config file of configs/ by path, as `main.py` does, for tests."""
import os

from k25jax.train import config_utils

ROOT = os.path.join(os.path.dirname(__file__), "..")


def load_config(path: str, arg=None):
  return config_utils.load_config_file(os.path.join(ROOT, path), arg)
