"""What a checkpoint costs the training it interrupts: the pre-training step's time alone and
with a save in flight, at the tiny and `small` presets (issue 43).

A save (`checkpoint.Checkpoints.save`, what every stage calls) computes the digests of every
array on device, then hands the state to Orbax, which copies the device arrays to host and
writes them in a background thread (its `CheckpointManager` saves asynchronously). The table
gives, per preset, the median of `--repeats`: a step alone; the blocking part of `save`
(digests + hand-off) and, timed apart, the digests alone and a copy of every array of the
state into new host memory (`np.array`: what "copying the device arrays to host" costs where
the device is the host); the step taken right after the save call while the write is in
flight; and the time from the save call until the write finished (`wait_until_finished`,
that step included). Times are wall-clock on this
machine, every step waited on (`block_until_ready`).

    python experiments/bench_checkpoint.py [--repeats 3] [--small-layers 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import pretrain as pretrain_config  # noqa: E402
from k25jax.data import tokenizer  # noqa: E402
from k25jax.model import transformer  # noqa: E402
from k25jax.stages import pretrain  # noqa: E402
from k25jax.train import checkpoint, config_utils, optimizer, sharding, trainer as trainer_lib  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_checkpoint.json")


def timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def bench(preset: str, repeats: int, layers: int | None) -> dict:
  config = pretrain_config.get_config(preset)
  if layers is not None:
    config.model.num_hidden_layers = layers
  config.train.update(batch=8, seq_len=128)
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  mesh = sharding.make_mesh({"data": -1})
  tok = tokenizer.load(config.data.tokenizer, config.data.vocab_file, media=False)
  data, _ = pretrain.datasets(config, tok)
  with jax.set_mesh(mesh), tempfile.TemporaryDirectory() as workdir:
    state = trainer_lib.new_state(model, tx, mesh, seed=0)
    step = pretrain.make_step(config, model, tx)
    batch = sharding.global_batch(next(data), sharding.batch_sharding(mesh))
    run = lambda s: jax.block_until_ready(step(s, batch))
    state, _ = run(state)                                   # compile
    saver = checkpoint.Checkpoints(workdir, keep=2)
    saver.save(0, state)                                    # compile the digests, warm Orbax
    saver.manager.wait_until_finished()
    rows = {"step_s": [], "save_call_s": [], "digests_s": [], "host_copy_s": [], "step_during_write_s": [],
            "write_s": []}
    for i in range(repeats):
      (state, _), alone = timed(lambda: run(state))
      rows["digests_s"].append(timed(lambda: checkpoint.digests(state))[1])
      rows["host_copy_s"].append(timed(lambda: [np.array(x) for x in jax.tree.leaves(state)])[1])
      start = time.perf_counter()
      _, call = timed(lambda: saver.save(i + 1, state))
      (state, _), during = timed(lambda: run(state))
      saver.manager.wait_until_finished()
      rows["step_s"].append(alone)
      rows["save_call_s"].append(call)
      rows["step_during_write_s"].append(during)
      rows["write_s"].append(time.perf_counter() - start)
    saver.close()
  params = sum(x.size for x in jax.tree.leaves(state.params))
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  return {"preset": preset, "layers": config.model.num_hidden_layers, "params": int(params),
          "state_bytes": int(state_bytes), **{k: statistics.median(v) for k, v in rows.items()},
          "raw": rows}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--small-layers", type=int, default=2, help="the small preset's layers (its 12 do not fit "
                      "this machine's memory with AdamW's moments)")
  args = parser.parse_args()
  results = [bench("tiny", args.repeats, None), bench("small", args.repeats, args.small_layers)]
  print(f"{'preset':8} {'layers':>6} {'params':>12} {'state MB':>9} {'step s':>8} {'save call s':>12} "
        f"{'of it digests s':>16} {'host copy s':>12} {'step during write s':>20} {'write s':>8}")
  for r in results:
    print(f"{r['preset']:8} {r['layers']:>6} {r['params']:>12,} {r['state_bytes'] / 2**20:>9.1f} {r['step_s']:>8.3f} "
          f"{r['save_call_s']:>12.3f} {r['digests_s']:>16.3f} {r['host_copy_s']:>12.3f} "
          f"{r['step_during_write_s']:>20.3f} {r['write_s']:>8.3f}")
  os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
  with open(RESULTS, "w") as f:
    json.dump({"devices": jax.device_count(), "platform": jax.devices()[0].platform, "results": results}, f, indent=1)
  print(f"wrote {RESULTS}")


if __name__ == "__main__":
  main()
