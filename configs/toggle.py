# python -m k25jax.main --config=configs/toggle.py --workdir=runs/toggle
"""RL with Toggle on: phases of m iterations alternate a length-budgeted reward (phase 0)
and the plain reward (phase 1). The same as `configs/rl.py:tiny,toggle`."""
import os

from k25jax.train.config_utils import load_config_file


def get_config(arg=None):
  return load_config_file(os.path.join(os.path.dirname(__file__), "rl.py"), ",".join([arg or "tiny", "toggle"]))
