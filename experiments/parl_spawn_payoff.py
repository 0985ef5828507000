"""Experiment: what splitting pays a PARL warm start before any RL (why serial collapse appears or not).

    python experiments/parl_spawn_payoff.py --workdir=DIR [--tasks 512 --samples 8 --min_width 8
        --set parl.subagent_failure=0.3 --out experiments/results/parl_spawn_payoff.json]

DIR is a `configs/parl.py` run: its warm start (DIR/warm_start, or `init.checkpoint`) is the
orchestrator and its frozen sub-agents (`parl.frozen_subagents`) play under it. On the wide tasks of at least --min_width entities among --tasks held-out
tasks (`parl.sample_tasks`, seed --seed), it samples --samples episodes per task at the
RL temperature, as the first RL iteration would (the environment as `--set` makes it, e.g.
sub-agents that fail or cost more steps, as `parl_ablation.py --set` plays it), and compares the episodes whose
orchestrator split (created a sub-agent) with those where it worked alone:

    share    = P(split)
    payoff   = mean over tasks with both kinds of episode of
               ( mean Item-F1 of its split episodes − mean Item-F1 of its solo episodes )

The payoff is the group advantage r_perf alone gives splitting (`losses.group_advantages`
subtracts the group mean): when it is clearly positive, RL with λ1 = 0 learns to split from
the few split samples, and serial collapse has nothing to come from; the paper's collapse
needs early splits that pay less than working alone. Prints the numbers and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from k25jax.model import transformer
from k25jax.stages import parl
from k25jax.train import config_utils, sharding, trainer as trainer_lib

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def payoff(split: np.ndarray, f1: np.ndarray, samples: int) -> dict:
  """split bool [tasks × samples], f1 [tasks × samples] (each task's samples consecutive) →
  the share of split episodes, their and the solo episodes' mean Item-F1, and the mean
  within-task difference over the tasks that have both kinds."""
  split, f1 = split.reshape(-1, samples), f1.reshape(-1, samples)
  both = split.any(axis=1) & (~split).any(axis=1)
  diffs = [f1[i][split[i]].mean() - f1[i][~split[i]].mean() for i in np.flatnonzero(both)]
  nan = float("nan")
  return {"episodes": int(split.size), "share_split": float(split.mean()),
          "f1_split": float(f1[split].mean()) if split.any() else nan,
          "f1_solo": float(f1[~split].mean()) if (~split).any() else nan,
          "tasks_with_both": int(both.sum()), "payoff": float(np.mean(diffs)) if diffs else nan}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="a configs/parl.py run")
  parser.add_argument("--tasks", type=int, default=512)
  parser.add_argument("--samples", type=int, default=8, help="episodes per task (RL's rl.num_generations)")
  parser.add_argument("--min_width", type=int, default=8)
  parser.add_argument("--seed", type=int, default=777)
  parser.add_argument("--set", action="append", default=[], help="section.field=value config override")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "parl_spawn_payoff.json"))
  args = parser.parse_args(argv)

  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "parl.py"), "tiny")
  config_utils.apply_overrides(config, args.set)
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  warm = trainer_lib.restore_params(model, config.init.checkpoint or os.path.join(args.workdir, "warm_start"), mesh)
  subagents = parl.frozen_subagents(config, args.workdir)
  tasks = [t for t in parl.sample_tasks(config, args.tasks, args.seed)
           if t.kind == "wide" and len(t.entities) >= args.min_width]
  episodes = [t for t in tasks for _ in range(args.samples)]
  results, _, _ = parl.play(config, model.cfg, warm, subagents, episodes, greedy=False, seed=args.seed)
  out = payoff(np.array([r.num_created > 0 for r in results]), np.array([r.score.item_f1 for r in results]),
               args.samples)
  out.update(workdir=os.path.abspath(args.workdir), tasks=len(tasks), min_width=args.min_width,
             temperature=config.rl.temperature, overrides=args.set)
  print(f"{out['episodes']} sampled episodes of {len(tasks)} wide tasks of >= {args.min_width} entities: the warm "
        f"start split in {out['share_split']:.3f} of them; Item-F1 {out['f1_split']:.3f} split vs "
        f"{out['f1_solo']:.3f} alone; within a task's group ({out['tasks_with_both']} tasks with both) splitting "
        f"paid {out['payoff']:+.3f} Item-F1")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {args.out}")
  return out


if __name__ == "__main__":
  main()
