"""Where the main job's time goes: README's PARL command, its phases and its compiles.

    python experiments/profile_parl.py [--workdir /tmp/k25jax_profile_parl]
        [--out experiments/results/profile_parl.json] [-- --config.train.seed=1 ...]   # after `--`: k25jax.main's flags

Runs `python -m k25jax.main --config=configs/parl.py --workdir=DIR` in this process (a fresh
workdir: an existing one is refused, since a resumed run skips phases), recording every
XLA compile (`jax.monitoring`'s backend-compile events: program name and seconds) and the
time of each log line. Then splits the wall time into phases:

    start-up + demonstrations   process start → the warm start's data logged (imports, the
                                6,000 scripted episodes, packing)
    warm start + eval 0         → the evaluation at iteration 0 logged
    rollouts, updates           the 80 iterations' `sample_s` and `train_s` (parl_curves.json)
    evaluations, bookkeeping    the rest of the iterations (evaluations at 20-80, logs, checkpoints)
    final table                 the evaluation at the last iteration → the end

and prints them with the compiles per program and the summary table. Writes `--out` (JSON).
Time it on a quiet machine (`uptime` before); the load is not measured here.
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Recorder(logging.Handler):
  """Keeps (time, message) of every log record (absl logs through the `absl` logger)."""

  def __init__(self):
    super().__init__()
    self.lines: list[tuple[float, str]] = []

  def emit(self, record):
    self.lines.append((record.created, record.getMessage()))

  def first(self, prefix: str) -> float:
    return next(t for t, message in self.lines if message.startswith(prefix))


def phases(start: float, end: float, log: Recorder, curves: list[dict]) -> dict[str, float]:
  """The module docstring's phases, in seconds."""
  train = [row for row in curves if row.get("split") == "train"]
  evals = [row for row in curves if row.get("split") == "eval"]
  packed, eval0 = log.first("warm start: "), log.first("parl eval at iteration 0")
  last_eval = log.first(f"parl eval at iteration {evals[-1]['iteration']}")
  sample, update = sum(r["sample_s"] for r in train), sum(r["train_s"] for r in train)
  return {"start-up + demonstrations": packed - start, "warm start + eval 0": eval0 - packed,
          "rollouts (sample_s)": sample, "updates (train_s)": update,
          "evaluations, bookkeeping": last_eval - eval0 - sample - update,
          "final table": end - last_eval, "total": end - start}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default="/tmp/k25jax_profile_parl")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "profile_parl.json"))
  parser.add_argument("main_flags", nargs="*", help="flags for k25jax.main, after `--`")
  args = parser.parse_args()
  if os.path.exists(args.workdir):
    sys.exit(f"--workdir {args.workdir} exists: a resumed run skips phases; give a fresh one")

  from absl import app
  from jax import monitoring
  from k25jax import main as k25jax_main
  compiles = []
  monitoring.register_event_duration_secs_listener(
      lambda event, seconds, **kw: compiles.append((kw.get("fun_name"), seconds)) if event == COMPILE_EVENT else None)
  log = Recorder()
  logging.getLogger("absl").addHandler(log)
  argv = ["k25jax.main", f"--config={ROOT}/configs/parl.py", f"--workdir={args.workdir}", *args.main_flags]
  start = time.time()
  try:
    app.run(k25jax_main.main, argv=argv, flags_parser=k25jax_main.parse_flags)
  except SystemExit as stop:
    if stop.code not in (0, None):
      raise
  end = time.time()

  with open(os.path.join(args.workdir, "parl_curves.json")) as f:
    curves = json.load(f)
  split = phases(start, end, log, curves)
  by_program = collections.defaultdict(lambda: [0, 0.0])
  for name, seconds in compiles:
    by_program[name][0] += 1
    by_program[name][1] += seconds
  print(f"\n{'phase':32s}{'seconds':>9s}")
  for name, seconds in split.items():
    print(f"{name:32s}{seconds:9.1f}")
  print(f"\n{'compiled program':32s}{'count':>7s}{'seconds':>9s}")
  for name, (count, seconds) in sorted(by_program.items(), key=lambda kv: -kv[1][1])[:8]:
    print(f"{name:32s}{count:7d}{seconds:9.1f}")
  final = curves[-1]["rows"]
  commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"commit": commit, "main_flags": args.main_flags, "phases_s": split,
               "compiles": {name: {"count": c, "seconds": s} for name, (c, s) in by_program.items()},
               "sample_s_per_iteration": [r["sample_s"] for r in curves if r.get("split") == "train"],
               "device_calls_per_iteration": [r["device_calls"] for r in curves if r.get("split") == "train"],
               "final_table": final}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
