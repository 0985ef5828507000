"""Checkpoints with Orbax: the train state (params, optimizer state, step, rng,
counters), the grain iterator state and a digest of every array, saved together under
`workdir/checkpoints/<step>`.

    digest(x) = Σ_i w_i · u_i  mod 2^32,   u = x's bits as unsigned words, w_i = (i · 0x9E3779B1) | 1

computed on device where x lives (exact: integer sums are associative, so any sharding
gives the same number). Every w_i is odd, so flipping any one bit of x changes its digest.

Restoring takes the latest step whose arrays read back with the digests they were saved
with. A step that cannot be read (missing or truncated files) or fails its digests is
moved aside to `workdir/checkpoints_quarantine/` (kept for inspection, never deleted),
with one warning line, and the previous step is tried, and so on: a corrupt step never
blocks the run from saving that step again.
"""
from __future__ import annotations

import contextlib
import gc
import logging as pylogging
import os
import sys
import tempfile
from typing import BinaryIO, Callable

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from k25jax.train import sharding

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def write_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
  """`write(f)` into a temporary file beside `path`, then renamed onto it: a reader (a
  resume after a crash, another process) finds the whole file or none."""
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "wb") as f:
      write(f)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


class CorruptCheckpoint(Exception):
  """A checkpoint whose arrays do not match the digests they were saved with."""


def _digest(x: jax.Array) -> jax.Array:
  """The module docstring's digest of one array, a uint32 scalar."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  else:
    words = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)
  words = words.reshape(-1)
  weights = (jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(0x9E3779B1)) | jnp.uint32(1)
  return jnp.sum(words * weights, dtype=jnp.uint32)


@jax.jit
def _digests(arrays: list[jax.Array]) -> list[jax.Array]:
  """`_digest` of each array, one program (compiled once per list of shapes and shardings: a
  run's saves after the first only compute)."""
  return [_digest(x) for x in arrays]


def digests(tree) -> dict[str, int]:
  """{path: digest} of every array leaf of `tree` (paths as `jax.tree_util.keystr`)."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  values = jax.device_get(_digests([x for _, x in leaves]))
  return {jax.tree_util.keystr(path): int(v) for (path, _), v in zip(leaves, values)}


def verify(tree, saved: dict[str, int]) -> None:
  """Raises CorruptCheckpoint naming the arrays of `tree` whose digests differ from `saved`."""
  bad = [path for path, value in digests(tree).items() if saved.get(path) != value]
  if bad:
    raise CorruptCheckpoint(f"{len(bad)} array(s) differ from the digests saved with them: {', '.join(bad[:3])}"
                            + (" ..." if len(bad) > 3 else ""))


def has_digests(directory: str, step: int) -> bool:
  return os.path.isdir(os.path.join(directory, str(step), "digests"))


def _check(tree, saved: dict[str, int] | None, step: int) -> None:
  """`verify`, or a warning for a checkpoint saved before digests were written."""
  if saved is None:
    logging.warning("checkpoint %d has no digests (saved before they were written): restored unverified", step)
  else:
    verify(tree, saved)


def _params_digests(saved: dict[str, int] | None) -> dict[str, int] | None:
  """The digests of the saved state's `params`, keyed by their paths within it (the state is a
  TrainState, `.params...`, or a dict, `['params']...`)."""
  if saved is None:
    return None
  prefixes = (".params", "['params']")
  return {key[len(p):]: value for key, value in saved.items() for p in prefixes if key.startswith(p)}


class _DropOrbaxRecords(pylogging.Filter):
  def filter(self, record: pylogging.LogRecord) -> bool:
    return f"{os.sep}orbax{os.sep}" not in record.pathname


@contextlib.contextmanager
def _quiet_orbax():
  """Meanwhile Orbax's own log records are dropped, and so are the tracebacks of the reads it
  abandons when one fails (coroutines collected with an exception inside, by the `gc.collect`
  after a failure: a collection costs ~0.3 s in a large process, so only a failure pays it):
  `restore_latest` reports an unreadable step in one line of its own."""
  quiet, hook = _DropOrbaxRecords(), sys.unraisablehook
  logger = pylogging.getLogger("absl")
  logger.addFilter(quiet)
  sys.unraisablehook = lambda unraisable: None
  try:
    yield
  except BaseException:
    gc.collect()
    raise
  finally:
    sys.unraisablehook = hook
    logger.removeFilter(quiet)


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
    self.quarantine = os.path.join(os.path.abspath(workdir), "checkpoints_quarantine")
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_names=("state", "data", "digests"))

  def save(self, step: int, state, data_iterator: grain.DatasetIterator | None = None) -> None:
    """Saves the state with its digests, and the data iterator's position when the stage
    reads a grain iterator (stages whose data is a pure function of the step pass None)."""
    items = {"state": ocp.args.StandardSave(state), "digests": ocp.args.JsonSave(digests(state))}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore_latest(self, target, data_iterator: grain.DatasetIterator | None = None):
    """The newest intact state (shaped and sharded like `target`, a tree of
    `jax.ShapeDtypeStruct` with shardings) with `data_iterator` set to its position, or
    None when there is no checkpoint; unreadable or corrupt steps are quarantined on the
    way (module docstring). Raises if checkpoints existed but none was intact."""
    self.manager.reload()
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      items = {"state": ocp.args.StandardRestore(target)}
      if has_digests(self.directory, step):
        items["digests"] = ocp.args.JsonRestore()
      if data_iterator is not None:
        items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
      with _quiet_orbax():
        try:
          restored = self.manager.restore(step, args=ocp.args.Composite(**items))
          _check(restored["state"], restored.get("digests"), step)
        except Exception as e:  # pylint: disable=broad-except  (any unreadable or corrupt checkpoint)
          gc.collect()     # the failed read's abandoned coroutines, while _quiet_orbax mutes them
          self._quarantine(step, e)
          continue
      logging.info("restored checkpoint %d from %s", step, self.directory)
      return restored["state"]
    if steps:
      raise RuntimeError(f"no intact checkpoint in {self.directory} (steps {steps} were moved to "
                         f"{self.quarantine}); move the workdir away to start afresh")
    return None

  def _quarantine(self, step: int, error: Exception) -> None:
    """Moves step `step` aside to `self.quarantine` (process 0 moves, every process waits)."""
    destination = os.path.join(self.quarantine, str(step))
    if jax.process_index() == 0:
      os.makedirs(self.quarantine, exist_ok=True)
      suffix = 1
      while os.path.exists(destination):
        destination, suffix = os.path.join(self.quarantine, f"{step}.{suffix}"), suffix + 1
      os.rename(os.path.join(self.directory, str(step)), destination)
    multihost_utils.sync_global_devices(f"quarantine checkpoint {step}")
    self.manager.reload()
    message = " ".join(str(error).split())
    logging.warning("checkpoint %d is unreadable or corrupt (%s: %s); moved to %s, trying the previous one",
                    step, type(error).__name__, message[:200] + ("..." if len(message) > 200 else ""), destination)

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


def _reader(directory: str, step: int | None = None) -> tuple[ocp.CheckpointManager, int]:
  """A reader of `directory` (a run's `checkpoints`) and its newest step (or `step`, which it
  must hold), as Orbax lists them; FileNotFoundError when it holds none (or not `step`)."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint in {directory}: expected the workdir of a run")
  reader = ocp.CheckpointManager(directory, item_names=("state", "digests"))
  steps = sorted(reader.all_steps())
  if not steps or (step is not None and step not in steps):
    reader.close()
    raise FileNotFoundError(f"no checkpoint in {directory}: expected the workdir of a run" if not steps else
                            f"{directory} has no checkpoint of step {step}; it has {steps}")
  return reader, steps[-1] if step is None else step


def saved_params_keys(workdir: str, step: int | None = None) -> tuple[str, ...]:
  """The top-level keys of the params in the newest checkpoint (or `step`'s) under
  `workdir/checkpoints` (read from its metadata, no array is loaded): e.g. ('language_model',
  'projector', 'vision_tower') for a K2.5 run, the decoder's own keys for a text run."""
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  reader, step = _reader(directory, step)
  reader.close()
  with _quiet_orbax():
    tree = ocp.PyTreeCheckpointer().metadata(os.path.join(directory, str(step), "state"))
  return tuple(tree.item_metadata["params"].keys())


def restore_params(workdir: str, target, under: str | None = None, step: int | None = None):
  """Only the params of the newest checkpoint (or `step`'s) under `workdir/checkpoints` (any stage's, whatever
  its optimizer), shaped and sharded like `target` (`params_target`), checked against their
  digests; with `under`, the saved `params[under]` (e.g. the language model of a K2.5 run for
  a text-only model). Raises FileNotFoundError when it holds no checkpoint, CorruptCheckpoint
  when the params differ from what was saved."""
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  reader, step = _reader(directory, step)
  wrapped = target if under is None else {under: target}
  restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), wrapped)
  items = {"state": ocp.args.PyTreeRestore(item={"params": wrapped}, restore_args={"params": restore_args},
                                           partial_restore=True)}
  if has_digests(directory, step):
    items["digests"] = ocp.args.JsonRestore()
  restored = reader.restore(step, args=ocp.args.Composite(**items))
  reader.close()
  params = restored["state"]["params"]
  _check(params, _params_digests(restored.get("digests")), step)
  logging.info("restored the params%s of checkpoint %d from %s", f"[{under!r}]" if under else "", step, directory)
  return params if under is None else params[under]
