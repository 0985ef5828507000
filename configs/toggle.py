# python -m k25jax.main --config=configs/toggle.py --workdir=runs/toggle
"""RL with Toggle on: phases of m iterations alternate a length-budgeted reward (phase 0)
and the plain reward (phase 1). The same as `configs/rl.py:tiny,toggle`."""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("configs_rl", os.path.join(os.path.dirname(__file__), "rl.py"))
_rl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_rl)


def get_config(arg=None):
  return _rl.get_config(",".join([arg or "tiny", "toggle"]))
