"""The newest checkpoint of a run's workdir, read back onto one device whatever mesh (or
processes) saved it: for tests that compare two runs' saved states leaf by leaf."""
import os

import jax
import numpy as np


def newest_state_dir(workdir: str) -> str:
  """workdir/checkpoints/<newest step>/state."""
  directory = os.path.join(workdir, "checkpoints")
  return os.path.join(directory, str(max(int(name) for name in os.listdir(directory) if name.isdigit())), "state")


def one_device_target(workdir: str):
  """The saved state's tree as `jax.ShapeDtypeStruct`s on this process's first device."""
  import orbax.checkpoint as ocp
  saved = ocp.PyTreeCheckpointer().metadata(newest_state_dir(workdir)).item_metadata
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved,
                      is_leaf=lambda m: hasattr(m, "shape"))


def by_key_path(tree) -> dict[str, np.ndarray]:
  """The leaves of `tree`, on the host, keyed by their key path."""
  return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(
      jax.device_get(tree))}
