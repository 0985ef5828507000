"""Loads a config file of configs/ by path, as `main.py` does, for tests."""
import importlib.util
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")


def load_config(path: str, arg=None):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3] + "_config", os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)
