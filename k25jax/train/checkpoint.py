"""Checkpoints with Orbax: the train state (params, optimizer state, step, rng,
counters) and the grain iterator state, saved together under `workdir/checkpoints/<step>`.

Restoring takes the latest step; if it cannot be read (a corrupt or truncated
checkpoint) the previous one is tried, with a warning, and so on.
"""
from __future__ import annotations

import os
import tempfile

import flax.linen as nn
import grain
import jax
import orbax.checkpoint as ocp
from absl import logging

from k25jax.train import sharding


def ensure_writable(workdir: str) -> None:
  """Creates `workdir` and writes a probe file, or raises a PermissionError saying why."""
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_probe"):
      pass
  except OSError as e:
    raise PermissionError(f"workdir {workdir!r} is not writable ({e.strerror or e}); "
                          "pass --workdir=<a directory you can write>") from e


class Checkpoints:
  """Save / restore (state, data iterator) pairs under `workdir/checkpoints`."""

  def __init__(self, workdir: str, keep: int):
    ensure_writable(workdir)
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_names=("state", "data"))

  def save(self, step: int, state, data_iterator: grain.DatasetIterator | None = None) -> None:
    """Saves the state, and the data iterator's position when the stage reads a grain
    iterator (stages whose data is a pure function of the step pass None)."""
    items = {"state": ocp.args.StandardSave(state)}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore_latest(self, target, data_iterator: grain.DatasetIterator | None = None):
    """The newest readable state (shaped and sharded like `target`, a tree of
    `jax.ShapeDtypeStruct` with shardings) with `data_iterator` set to its position,
    or None when there is no checkpoint. Raises if checkpoints exist but none is readable."""
    self.manager.reload()
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      try:
        items = {"state": ocp.args.StandardRestore(target)}
        if data_iterator is not None:
          items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
      except Exception as e:  # pylint: disable=broad-except  (any unreadable checkpoint)
        logging.warning("checkpoint %d in %s is unreadable (%s: %s); falling back to the previous one",
                        step, self.directory, type(e).__name__, str(e)[:300])
        continue
      logging.info("restored checkpoint %d from %s", step, self.directory)
      return restored["state"]
    if steps:
      raise RuntimeError(f"no readable checkpoint in {self.directory} (tried steps {steps}); "
                         "move the directory away to start afresh")
    return None

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_target(unboxed_abstract, shardings):
  """ShapeDtypeStructs with shardings: what `restore_latest` restores into."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      unboxed_abstract, shardings)


def params_target(boxed_params, mesh: jax.sharding.Mesh):
  """What `restore_params` restores into: the shapes of abstract params in their
  `nn.LogicallyPartitioned` boxes, sharded over `mesh` by the logical rules."""
  return abstract_target(nn.meta.unbox(boxed_params), sharding.logical_to_sharding(boxed_params, mesh))


def restore_params(workdir: str, target):
  """Only the params of the newest checkpoint under `workdir/checkpoints` (any stage's, whatever
  its optimizer), shaped and sharded like `target` (`params_target`). Raises FileNotFoundError
  when it holds no checkpoint."""
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint in {directory}: expected the workdir of a run")
  reader = ocp.CheckpointManager(directory, item_names=("state",))
  steps = sorted(reader.all_steps())
  if not steps:
    reader.close()
    raise FileNotFoundError(f"no checkpoint in {directory}: expected the workdir of a run")
  restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target)
  restored = reader.restore(steps[-1], args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      item={"params": target}, restore_args={"params": restore_args}, partial_restore=True)))
  reader.close()
  logging.info("restored the params of checkpoint %d from %s", steps[-1], directory)
  return restored["state"]["params"]
