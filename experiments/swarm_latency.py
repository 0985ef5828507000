"""Experiment: Item-F1 against critical steps and wall time, trained swarm vs single agent (K2.5 Fig. 8 shape).

    python experiments/swarm_latency.py --workdir=DIR [--budgets 2,3,4,5,6,7,8,9,10 --tasks 64
        --latency_tasks 16 --targets 0.5,0.7,0.8,0.9 --out experiments/results/swarm_latency]

DIR is a finished `configs/parl.py` run: the trained orchestrator is restored from
DIR/checkpoints, the warm start (the frozen sub-agents, and the single agent) from
DIR/warm_start. For every CriticalSteps budget B, the same held-out WIDE tasks (n in
--n_range, fixed --seed, none of them a training task) are played greedily by
* swarm:  the trained orchestrator with the frozen sub-agents,
* single: the warm-start model with `create`/`assign` banned (`parl.play(solo=True)`),
* (--warm_swarm) the warm-start model as orchestrator, untrained;
* (--scripted) references with no model: the scripted single agent (`solo_policy`:
  one search per step, answers when done or stopped) and the scripted swarm
  (`ScriptedOrchestrator(8)`: n sub-agents of one entity each, scripted too), i.e. the
  environment's own steps-vs-F1 curves (no device calls, so no latency).
Per (policy, B): Item-F1, success, sub-agents and critical steps used per episode; wall
time of the whole batch (the second of two runs: the first compiles); and the latency of
one episode played alone (the runtime still batches that episode's sub-agents), the mean
over the first --latency_tasks tasks, after a warm-up pass over the same tasks.

Then, for each target Item-F1, the smallest mean critical steps (and the smallest
latency) at which each policy reaches it over the budgets tried (no interpolation
between budgets; "not reached" otherwise), and the ratio single / swarm. Writes
`<out>.json` and `<out>.png` (Item-F1 vs critical steps, and vs latency). The budget is
also the episode's limit, so a policy's steps used at budget B are at most B.
About 3–5 minutes on 2 free cores with the defaults (most of it compiling the sampler
for the batch shapes of every budget).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from k25jax.agents import widesearch  # noqa: E402
from k25jax.model import transformer  # noqa: E402
from k25jax.stages import parl  # noqa: E402
from k25jax.train import config_utils, sharding, trainer as trainer_lib  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
COLORS = {"swarm": "tab:blue", "single": "tab:red", "swarm (warm start)": "tab:gray",
          "swarm (scripted)": "tab:cyan", "single (scripted)": "tab:pink"}
SCRIPTED = {"swarm (scripted)": 8, "single (scripted)": 0}     # ScriptedOrchestrator(k)


def load_config():
  return config_utils.load_config_file(os.path.join(ROOT, "configs", "parl.py"), "tiny")


def measure(config, model_cfg, orch, sub, tasks, *, solo: bool, latency_tasks: int) -> dict:
  """One (policy, budget) point: metrics of the batch, its wall time, per-episode latency alone."""
  play = lambda ts: parl.play(config, model_cfg, orch, sub, ts, greedy=True, solo=solo)
  play(tasks)                                        # compiles this budget's batch shapes
  results, runtime, wall = play(tasks)
  point = parl.summarize(results, wall)
  point.update(device_calls=float(sum(runtime.device_calls.values())), overflows=runtime.overflows,
               episodes=len(results), finish_rate=point["num_finished"] / max(point["num_assigned"], 1e-9))
  alone = tasks[:latency_tasks]
  for t in alone:                                    # warm-up: the shapes of one episode at a time
    play([t])
  latencies, calls = [], []
  for t in alone:
    _, rt, w = play([t])
    latencies.append(w)
    calls.append(sum(rt.device_calls.values()))
  point.update(latency_s=float(np.mean(latencies)), latency_median_s=float(np.median(latencies)),
               calls_per_episode_alone=float(np.mean(calls)))
  return point


def measure_scripted(tasks, k: int, budget: int) -> dict:
  """A reference point: scripted orchestrator (k sub-agents) and scripted sub-agents, no model."""
  start = time.perf_counter()
  results = [widesearch.run_episode(t, widesearch.ScriptedOrchestrator(k), budget=budget) for t in tasks]
  point = parl.summarize(results, time.perf_counter() - start)
  point.update(device_calls=0.0, overflows=0, episodes=len(results), latency_s=float("nan"),
               latency_median_s=float("nan"), calls_per_episode_alone=0.0,
               finish_rate=point["num_finished"] / max(point["num_assigned"], 1e-9))
  return point


def reach(points: list[dict], target: float) -> dict:
  """The cheapest budget point at which item_f1 >= target, by critical steps and by latency."""
  hit = [p for p in points if p["item_f1"] >= target]
  if not hit:
    return {"reached": False}
  by_steps = min(hit, key=lambda p: (p["critical_steps"], p["latency_s"]))
  timed = [p for p in hit if np.isfinite(p["latency_s"])]
  by_time = min(timed, key=lambda p: p["latency_s"]) if timed else {"latency_s": float("nan"), "budget": None}
  return {"reached": True, "critical_steps": by_steps["critical_steps"], "budget": by_steps["budget"],
          "item_f1": by_steps["item_f1"], "latency_s_at_those_steps": by_steps["latency_s"],
          "latency_s": by_time["latency_s"], "budget_by_latency": by_time["budget"]}


def plot(curves: dict[str, list[dict]], targets: list[float], path: str, title: str) -> None:
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
  for name, points in curves.items():
    color = COLORS.get(name)
    steps = [p["critical_steps"] for p in points]
    f1 = [p["item_f1"] for p in points]
    axes[0].plot(steps, f1, "o--" if name in SCRIPTED else "o-", color=color, label=name, ms=4)
    for p in points:
      axes[0].annotate(f"B{p['budget']}", (p["critical_steps"], p["item_f1"]), fontsize=7, color=color,
                       textcoords="offset points", xytext=(3, -9))
    if name not in SCRIPTED:
      axes[1].plot([1e3 * p["latency_s"] for p in points], f1, "o-", color=color, label=name)
  for ax in axes:
    for t in targets:
      ax.axhline(t, color="k", lw=0.5, ls=":")
    ax.set_ylabel("Item-F1 (held-out wide tasks)")
    ax.grid(alpha=0.3)
    ax.legend()
  axes[0].set_xlabel("critical steps used (mean per episode; labels: budget B)")
  axes[1].set_xlabel("wall time per episode played alone (ms)")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="a finished configs/parl.py run")
  parser.add_argument("--budgets", default="2,3,4,5,6,7,8,9,10")
  parser.add_argument("--tasks", type=int, default=64)
  parser.add_argument("--n_range", default="2,8", help="entities per wide task, inclusive")
  parser.add_argument("--seed", type=int, default=20261129)
  parser.add_argument("--latency_tasks", type=int, default=16)
  parser.add_argument("--targets", default="0.5,0.7,0.8,0.9")
  parser.add_argument("--warm_swarm", action="store_true", help="also the untrained (warm-start) swarm")
  parser.add_argument("--scripted", action="store_true", help="also the scripted single agent and swarm")
  parser.add_argument("--set", action="append", default=[], help="section.field=value config override")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "swarm_latency"))
  args = parser.parse_args()

  budgets = [int(b) for b in args.budgets.split(",")]
  targets = [float(t) for t in args.targets.split(",")]
  n_range = tuple(int(n) for n in args.n_range.split(","))
  config = load_config()
  config_utils.apply_overrides(config, args.set)
  model_cfg = config_utils.model_config_from(config.model)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  tasks = widesearch.sample_tasks(args.tasks, args.seed, deep_fraction=0.0, n_range=n_range)
  start = time.perf_counter()
  model = transformer.Transformer(model_cfg)
  restore = lambda path: trainer_lib.restore_params(model, path, mesh)   # the newest checkpoint's params (RL or SFT)
  with jax.set_mesh(mesh):
    trained = restore(args.workdir)
    warm = restore(os.path.join(args.workdir, "warm_start"))
    sub = restore(config.parl.subagent_checkpoint) if config.parl.subagent_checkpoint else warm
    policies = {"swarm": (trained, False), "single": (warm, True)}
    if args.warm_swarm:
      policies["swarm (warm start)"] = (warm, False)
    curves = {name: [] for name in [*policies, *(SCRIPTED if args.scripted else ())]}
    print(f"{'policy':>18s} {'B':>3s} {'Item-F1':>7s} {'success':>7s} {'sub-agents':>10s} {'crit.steps':>10s} "
          f"{'batch wall s':>12s} {'latency ms':>10s} {'calls/ep':>8s} {'overflows':>9s}")
    for budget in budgets:
      config.parl.budget = budget
      for name in curves:
        if name in SCRIPTED:
          point = {"budget": budget, **measure_scripted(tasks, SCRIPTED[name], budget)}
        else:
          orch, solo = policies[name]
          point = {"budget": budget, **measure(config, model_cfg, orch, sub, tasks, solo=solo,
                                               latency_tasks=args.latency_tasks)}
        curves[name].append(point)
        print(f"{name:>18s} {budget:3d} {point['item_f1']:7.3f} {point['success']:7.3f} "
              f"{point['num_created']:10.2f} {point['critical_steps']:10.2f} {point['wall_s']:12.3f} "
              f"{1e3 * point['latency_s']:10.1f} {point['calls_per_episode_alone']:8.1f} {point['overflows']:9d}",
              flush=True)

  table = []
  for t in targets:
    row = {"target": t, **{name: reach(points, t) for name, points in curves.items()}}
    s, o = row["swarm"], row["single"]
    if s["reached"] and o["reached"]:
      row["steps_ratio_single_over_swarm"] = o["critical_steps"] / s["critical_steps"]
      row["latency_ratio_single_over_swarm"] = o["latency_s"] / s["latency_s"]
    table.append(row)

  cell = lambda r, key, scale=1.0, fmt="{:.2f}": fmt.format(scale * r[key]) if r["reached"] else "not reached"
  print(f"\nsmallest cost at which each policy reaches the target Item-F1 ({len(tasks)} wide tasks, "
        f"n {n_range[0]}..{n_range[1]}, budgets {budgets[0]}..{budgets[-1]}, greedy)")
  print(f"{'target':>6s} {'swarm steps':>12s} {'single steps':>12s} {'ratio':>6s} {'swarm ms':>12s} "
        f"{'single ms':>12s} {'ratio':>6s}")
  for row in table:
    s, o = row["swarm"], row["single"]
    print(f"{row['target']:6.2f} {cell(s, 'critical_steps'):>12s} {cell(o, 'critical_steps'):>12s} "
          f"{row.get('steps_ratio_single_over_swarm', float('nan')):6.2f} "
          f"{cell(s, 'latency_s', 1e3, '{:.1f}'):>12s} {cell(o, 'latency_s', 1e3, '{:.1f}'):>12s} "
          f"{row.get('latency_ratio_single_over_swarm', float('nan')):6.2f}")
  if args.scripted:
    print("scripted references (no model): critical steps to reach the target")
    for row in table:
      s, o = row["swarm (scripted)"], row["single (scripted)"]
      ratio = o["critical_steps"] / s["critical_steps"] if s["reached"] and o["reached"] else float("nan")
      row["scripted_steps_ratio_single_over_swarm"] = ratio
      print(f"{row['target']:6.2f} {cell(s, 'critical_steps'):>12s} {cell(o, 'critical_steps'):>12s} {ratio:6.2f}")
  elapsed = time.perf_counter() - start
  print(f"elapsed {elapsed:.0f} s")

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  title = (f"{os.path.abspath(args.workdir)}: {len(tasks)} held-out wide tasks (n {n_range[0]}..{n_range[1]}), "
           f"budgets {budgets[0]}..{budgets[-1]}, greedy")
  plot(curves, targets, args.out + ".png", title)
  with open(args.out + ".json", "w") as f:
    json.dump({"workdir": os.path.abspath(args.workdir), "tasks": len(tasks), "n_range": n_range,
               "seed": args.seed, "budgets": budgets, "latency_tasks": args.latency_tasks, "curves": curves,
               "targets": table, "overrides": args.set, "elapsed_s": elapsed,
               "threads": len(os.sched_getaffinity(0)), "jax": jax.__version__}, f, indent=1)
  print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
  main()
