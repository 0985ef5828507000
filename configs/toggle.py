# python -m k25jax.main --config=configs/toggle.py --workdir=runs/toggle
"""RL with Toggle on: phases of m iterations alternate a length-budgeted reward (phase 0)
and the plain reward (phase 1). The same as `configs/rl.py:tiny,toggle`."""
from configs import rl


def get_config(arg=None):
  return rl.get_config(",".join([arg or "tiny", "toggle"]))
