"""Entry point: `python -m k25jax.main --config=configs/<stage>.py[:preset] [--workdir=DIR]`.

Any config field can be overridden (`--config.optimizer.lr=1e-3`); unknown fields fail.
Multi-process runs (several hosts, or several processes on one host) call
`jax.distributed.initialize` first: pass --coordinator_address/--num_processes/--process_id,
or set JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID, or run under a cluster
jax detects itself (SLURM, Open MPI, TPU pods) with --distributed.

Exit status: 0 the run finished; 1 it diverged (one line names the last good checkpoint); 2 a
bad flag or config field (one line, before anything is built) or a data file, record or glob
that cannot be used (one line naming it: `k25jax.data.files.BadData`); 143 (preemption.EXIT_PREEMPTED)
SIGTERM or SIGINT stopped it after saving a checkpoint: the same command resumes it.
"""
from __future__ import annotations

import importlib
import logging as pylogging
import os
import pkgutil
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from k25jax import stages, tpu_probe
from k25jax.data import files
from k25jax.train import config_check, config_utils, loop, preemption

STAGES = tuple(sorted(m.name for m in pkgutil.iter_modules(stages.__path__)))

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/<stage>.py[:preset]", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and TensorBoard logs; default runs/<stage>.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (multi-process).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (multi-process).")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False,
                                 "Call jax.distributed.initialize() and let jax detect the cluster.")


def distributed_args() -> dict | None:
  """jax.distributed.initialize arguments from the flags, else the JAX_* environment;
  None for a single-process run."""
  env = lambda name: os.environ.get(name) or None
  address = _COORDINATOR.value or env("JAX_COORDINATOR_ADDRESS")
  num = _NUM_PROCESSES.value if _NUM_PROCESSES.value is not None else env("JAX_NUM_PROCESSES")
  pid = _PROCESS_ID.value if _PROCESS_ID.value is not None else env("JAX_PROCESS_ID")
  num, pid = (None if num is None else int(num)), (None if pid is None else int(pid))
  if not (_DISTRIBUTED.value or address or (num or 1) > 1):
    return None
  return dict(coordinator_address=address, num_processes=num, process_id=pid)


def fail(message: str, code: int) -> None:
  """A user's error (a bad flag or config field, a diverged run): one line on stderr, no traceback."""
  sys.stderr.write(f"error: {message}\n")
  sys.exit(code)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with the checkout of the --config file on sys.path first (config
  files import `configs.common`, wherever the command runs from); an override of a field
  the config does not have fails in one line naming it."""
  config_arg = None
  for i, arg in enumerate(argv[1:], start=1):
    path = arg.split("=", 1)[1] if arg.startswith("--config=") else (
        argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None)
    if path:
      config_arg = path
      config_utils.put_checkout_on_path(path.split(":", 1)[0])
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError) as e:   # ml_collections: an override names no field
    path, _, preset = (config_arg or "").partition(":")
    config = config_utils.load_config_file(path, preset or None)
    for arg in argv[1:]:
      if arg.startswith("--config."):
        reason = config_check.unknown_field(config, arg[len("--config."):].partition("=")[0])
        if reason:
          fail(f"{arg}: {reason}", 2)
    fail(f"a --config override names no field of the config ({e})", 2)


class _QuietLibraries(pylogging.Filter):
  """Drops INFO records of Orbax and XLA's backend probing; their warnings still pass."""

  NOISY = (f"{os.sep}orbax{os.sep}", "xla_bridge.py")

  def filter(self, record: pylogging.LogRecord) -> bool:
    return record.levelno >= pylogging.WARNING or not any(n in record.pathname for n in self.NOISY)


def check_fields(config) -> None:
  """Every field's rule (`config_check.validate`), the stage's name among the stage modules.
  Raises ValueError, one line."""
  config_check.validate(config, rules={"stage": config_check.choice(*STAGES)})


def checked_stage(config):
  """The stage module `config.stage` names, once its own `check(config)` passed (its lengths
  against `train.steps`, the fields only it knows; raises ValueError, one line). Imported
  after `jax.distributed.initialize`: nothing a stage imports may start a backend before it."""
  stage = importlib.import_module(f"k25jax.stages.{config.stage}")
  stage.check(config)
  return stage


def main(argv):
  logging.get_absl_handler().addFilter(_QuietLibraries())   # every record reaches this handler
  tpu_probe.quiet_tpu_probe()
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config=configs/<stage>.py[:preset] is required")
  try:
    if config.get("init", {}).get("hf_checkpoint"):
      given = {arg[len("--config.model."):].split("=")[0] for arg in sys.argv if arg.startswith("--config.model.")}
      changed = config_utils.model_section_from_hf(config, given)
      logging.info("model section from %s: %s", config.init.hf_checkpoint, ", ".join(changed) or "unchanged")
    check_fields(config)
  except (ValueError, FileNotFoundError) as e:
    fail(str(e), 2)
  distributed = distributed_args()
  if distributed is not None:
    jax.distributed.initialize(**distributed)
  try:
    stage = checked_stage(config)
  except ValueError as e:
    fail(str(e), 2)
  logging.info("process %d of %d, %d devices: %s", jax.process_index(), jax.process_count(),
               jax.device_count(), jax.devices()[0].platform)
  try:
    stage.run(config, _WORKDIR.value or os.path.join("runs", config.stage))
  except loop.Diverged as e:
    fail(str(e), 1)
  except files.BadData as e:
    fail(str(e), 2)
  except preemption.Preempted as e:       # the checkpoint is written: the Trainer waited for it on exit
    logging.warning("%s", e)
    sys.exit(preemption.EXIT_PREEMPTED)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
