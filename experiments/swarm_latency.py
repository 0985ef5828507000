"""Experiment: K2.5's Fig. 8 at tiny scale: critical steps (and wall time) to reach a target
Item-F1 on wide tasks of growing width, trained swarm vs single agent.

    python experiments/swarm_latency.py --workdir=DIR [--widths 4,8,12,16,20,24 --budgets 2,3,...,16
        --tasks 24 --targets 0.5,0.7,0.9 --warm_swarm --scripted --out experiments/results/swarm_latency]
    python experiments/swarm_latency.py --scripted --out /tmp/swarm_latency_scripted   # references only, no model

DIR is a finished `configs/parl.py` run: the trained orchestrator is restored from
DIR/checkpoints, the run's start (the frozen sub-agents and the single agent) from
`init.checkpoint`, else DIR/warm_start. For every width W in --widths, --tasks held-out
WIDE tasks of exactly W entities (`widesearch.make_task((seed, W, i), kind="wide", n=W)`:
seeds of three ints, so none is a training or eval task of the stage, which draw from
pairs) are played, for every budget B in --budgets (the same tasks and tables, only the
budget in the prompt changes), greedily by
* swarm:  the trained orchestrator with the frozen sub-agents,
* single: the warm-start model with `create`/`assign` banned (`parl.play(solo=True)`),
* (--warm_swarm) the warm-start model as orchestrator, untrained;
* (--scripted) references with no model: the scripted single agent
  (`ScriptedOrchestrator(0)`: one search per step, B − 1 lookups, then the answer) and
  the scripted swarm (`ScriptedOrchestrator(8)`: min(W, 8) sub-agents of B − 2 steps each
  on near-equal chunks), i.e. the environment's own steps-vs-F1 curves.
The RL orchestrator was trained on budgets `parl.budget_range` (3..10) only, the warm
start on `warm_start.budget_range` (3..16): every policy is evaluated on every budget, and
a point outside its policy's training range is marked (`outside_training_budgets`; `*`
in the tables, hollow in the plot).

Per (policy, W, B): Item-F1, success, sub-agents created per episode, critical steps used
per episode, and the batch's wall time (the second of two identical runs: the first
compiles the sampler's shapes; NaN for the scripted policies, which make no device call).
Then for each target Item-F1 and width: the smallest mean critical steps (and, separately,
the smallest batch wall time) over the budgets tried at which each policy's mean Item-F1
reaches the target (no interpolation between budgets; a 1e-9 tolerance, so the scripted
agents' exact 0.5 counts), and the speedup single / swarm (NaN, "not reached", when
either does not reach it). Writes `<out>.json`, `<out>.png` (critical steps to reach each
target vs width; speedup vs width; Item-F1 vs critical steps at the widest width) and
prints the tables. The budget is the episode's limit, so steps used at budget B are ≤ B.
Cost: 2 plays of --tasks episodes per (policy, W, B): 2 × 6 × 15 × 2 = 360 plays with the
defaults (not timed on this version of the environment); --scripted alone takes seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

import interleave  # noqa: E402  (experiments/interleave.py, beside this script)
from k25jax.agents import dsl, widesearch  # noqa: E402
from k25jax.model import transformer  # noqa: E402
from k25jax.stages import parl  # noqa: E402
from k25jax.train import config_utils, sharding, trainer as trainer_lib  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
COLORS = {"swarm": "tab:blue", "single": "tab:red", "swarm (warm start)": "tab:gray",
          "swarm (scripted)": "tab:cyan", "single (scripted)": "tab:pink"}
SCRIPTED = {"swarm (scripted)": 8, "single (scripted)": 0}     # ScriptedOrchestrator(k)
PAIRS = (("swarm", "single"), ("swarm (warm start)", "single"), ("swarm (scripted)", "single (scripted)"))
TOLERANCE = 1e-9        # Item-F1 within this of the target counts as reaching it
DEFAULT_SEED = 20261129


def load_config():
  return config_utils.load_config_file(os.path.join(ROOT, "configs", "parl.py"), "tiny")


def wide_tasks(seed: int, width: int, num: int) -> list[widesearch.Task]:
  """`num` held-out wide tasks of exactly `width` entities (their budget is set per point)."""
  return [widesearch.make_task((seed, width, i), kind="wide", n=width, budget=dsl.MAX_BUDGET) for i in range(num)]


def _point(results, wall: float, **extra) -> dict:
  """A (policy, W, B) point from the episodes' results (`parl.summarize`'s overall means)."""
  s = parl.summarize(results, wall)
  return {**{k: s[k] for k in parl.SUMMARY_METRICS}, "wall_s": wall, "episodes": len(results), **extra}


def measure_scripted(tasks, k: int) -> dict:
  """A reference point: the scripted orchestrator with k sub-agents (k = 0: alone), no model."""
  results = [widesearch.run_episode(t, widesearch.ScriptedOrchestrator(k)) for t in tasks]
  return _point(results, float("nan"), device_calls=0.0, overflows=0)


def measure(config, model_cfg, orch, sub, tasks, *, solo: bool) -> dict:
  """A model point, played greedily: the second of two identical runs (the first compiles),
  with the cores other processes used while it was timed (`other_cores`)."""
  play = lambda: parl.play(config, model_cfg, orch, sub, tasks, greedy=True, solo=solo)
  play()
  with interleave.LoadMeter() as load:
    results, runtime, wall = play()
  return _point(results, wall, device_calls=float(sum(runtime.device_calls.values())),
                overflows=int(runtime.overflows), other_cores=load.other_cores)


def sweep(measure_fn, policies, widths, budgets, tasks_of, training_budgets, log=print) -> dict[str, list[dict]]:
  """curves[policy] = one point per (W, B): measure_fn(policy, tasks) on tasks_of(W) under
  budget B; `training_budgets[policy]` is the (lo, hi) it was trained on, or None."""
  curves = {name: [] for name in policies}
  log(f"{'policy':>18s} {'W':>3s} {'B':>3s} {'Item-F1':>7s} {'success':>7s} {'sub-agents':>10s} "
      f"{'crit.steps':>10s} {'batch wall s':>12s}")
  for width in widths:
    base = tasks_of(width)
    for budget in budgets:
      tasks = [t.with_budget(budget) for t in base]
      for name in policies:
        trained = training_budgets.get(name)
        outside = trained is not None and not trained[0] <= budget <= trained[1]
        point = {"width": width, "budget": budget, "outside_training_budgets": outside, **measure_fn(name, tasks)}
        curves[name].append(point)
        log(f"{name:>18s} {width:3d} {budget:3d}{'*' if outside else ' '}{point['item_f1']:6.3f} "
            f"{point['success']:7.3f} {point['num_created']:10.2f} {point['critical_steps']:10.2f} "
            f"{point['wall_s']:12.3f}")
  return curves


def reach(points: list[dict], target: float) -> dict:
  """The cheapest point at which the mean Item-F1 reaches `target`: by critical steps (ties:
  the lower wall time) and, separately, by batch wall time."""
  hit = [p for p in points if p["item_f1"] >= target - TOLERANCE]
  if not hit:
    return {"reached": False}
  by_steps = min(hit, key=lambda p: (p["critical_steps"], p["wall_s"] if math.isfinite(p["wall_s"]) else 0.0))
  timed = [p for p in hit if math.isfinite(p["wall_s"])]
  by_wall = min(timed, key=lambda p: p["wall_s"]) if timed else {"wall_s": float("nan"), "budget": None,
                                                                  "outside_training_budgets": False}
  return {"reached": True, "critical_steps": by_steps["critical_steps"], "budget": by_steps["budget"],
          "item_f1": by_steps["item_f1"], "outside_training_budgets": by_steps["outside_training_budgets"],
          "wall_s_at_those_steps": by_steps["wall_s"], "wall_s": by_wall["wall_s"],
          "budget_by_wall": by_wall["budget"], "outside_training_budgets_by_wall": by_wall["outside_training_budgets"]}


def ratio(single: dict, swarm: dict, key: str) -> float:
  """single / swarm of `key` when both reached the target (and the value is finite), else NaN."""
  if not (single["reached"] and swarm["reached"]):
    return float("nan")
  a, b = single[key], swarm[key]
  return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else float("nan")


def target_table(curves: dict[str, list[dict]], targets, widths) -> list[dict]:
  """Per target and width: each policy's `reach`, and for each (swarm, single) pair present
  the speedups single / swarm in critical steps and in wall time."""
  table = []
  for target in targets:
    for width in widths:
      row = {"target": target, "width": width,
             "reach": {name: reach([p for p in points if p["width"] == width], target)
                       for name, points in curves.items()}}
      row["speedup"] = {}
      for swarm, single in PAIRS:
        if swarm in curves and single in curves:
          o, s = row["reach"][single], row["reach"][swarm]
          row["speedup"][f"{single} / {swarm}"] = {"steps": ratio(o, s, "critical_steps"),
                                                   "wall": ratio(o, s, "wall_s")}
      table.append(row)
  return table


def _cell(r: dict, key: str, fmt: str = "{:.2f}") -> str:
  if not r["reached"] or not math.isfinite(r[key]):
    return "not reached" if not r["reached"] else "-"
  steps = key == "critical_steps"
  mark = "*" if r["outside_training_budgets" if steps else "outside_training_budgets_by_wall"] else ""
  budget = f" B{r['budget' if steps else 'budget_by_wall']}"
  return fmt.format(r[key]) + budget + mark


def print_tables(table: list[dict], curves: dict, log=print) -> None:
  for swarm, single in PAIRS:
    if swarm not in curves or single not in curves:
      continue
    key = f"{single} / {swarm}"
    log(f"\n{swarm} vs {single}: smallest mean critical steps (at budget B) and batch wall time at which the mean "
        "Item-F1 reaches the target; speedup = single / swarm (* = a budget outside the policy's training range)")
    log(f"{'target':>6s} {'W':>3s} {'swarm steps':>14s} {'single steps':>14s} {'speedup':>7s} "
        f"{'swarm wall s':>14s} {'single wall s':>14s} {'speedup':>7s}")
    for row in table:
      s, o, sp = row["reach"][swarm], row["reach"][single], row["speedup"][key]
      log(f"{row['target']:6.2f} {row['width']:3d} {_cell(s, 'critical_steps'):>14s} "
          f"{_cell(o, 'critical_steps'):>14s} {sp['steps']:7.2f} {_cell(s, 'wall_s', '{:.3f}'):>14s} "
          f"{_cell(o, 'wall_s', '{:.3f}'):>14s} {sp['wall']:7.2f}")


def plot(curves: dict, table: list[dict], targets, widths, path: str, title: str) -> None:
  fig, axes = plt.subplots(1, 3, figsize=(18, 5))
  styles = ("o-", "s--", "^:", "d-.")
  for i, target in enumerate(targets):
    rows = [r for r in table if r["target"] == target]
    for name in curves:
      steps = [r["reach"][name]["critical_steps"] if r["reach"][name]["reached"] else np.nan for r in rows]
      axes[0].plot([r["width"] for r in rows], steps, styles[i % len(styles)], color=COLORS.get(name),
                   label=f"{name}, F1 ≥ {target}", ms=4, alpha=0.5 if name in SCRIPTED else 1.0)
    for swarm, single in PAIRS:
      key = f"{single} / {swarm}"
      if rows and key in rows[0]["speedup"]:
        axes[1].plot([r["width"] for r in rows], [r["speedup"][key]["steps"] for r in rows], styles[i % len(styles)],
                     color=COLORS.get(swarm), label=f"{key}, F1 ≥ {target}", ms=4,
                     alpha=0.5 if swarm in SCRIPTED else 1.0)
  widest = max(widths)
  for name, points in curves.items():
    at = [p for p in points if p["width"] == widest]
    color = COLORS.get(name)
    axes[2].plot([p["critical_steps"] for p in at], [p["item_f1"] for p in at], "--" if name in SCRIPTED else "-",
                 color=color, label=name, lw=1)
    for p in at:
      axes[2].plot(p["critical_steps"], p["item_f1"], "o", color=color, ms=4,
                   mfc="none" if p["outside_training_budgets"] else color)
      axes[2].annotate(f"B{p['budget']}", (p["critical_steps"], p["item_f1"]), fontsize=6, color=color,
                       textcoords="offset points", xytext=(3, -8))
  for t in targets:
    axes[2].axhline(t, color="k", lw=0.5, ls=":")
  axes[1].axhline(1.0, color="k", lw=0.5, ls=":")
  axes[0].set(xlabel="width W (entities per wide task)", ylabel="critical steps to reach the target Item-F1",
              title="critical steps to reach the target (missing: not reached)")
  axes[1].set(xlabel="width W", ylabel="speedup in critical steps (single / swarm)", title="speedup")
  axes[2].set(xlabel="critical steps used (mean per episode; labels: budget B; hollow: outside the policy's "
              "training budgets)", ylabel="Item-F1", title=f"Item-F1 vs critical steps at W = {widest}")
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def max_other_cores(curves: dict) -> float:
  """The most cores other processes used while any of a sweep's plays was timed (0: none timed)."""
  return max((p["other_cores"] for points in curves.values() for p in points if "other_cores" in p), default=0.0)


def seed_summary(paths: list[str], pair: str = "single / swarm") -> dict:
  """Per target and width, the critical-step speedup `pair` of each saved sweep (one per
  trained seed) and their mean over the sweeps that reached the target (NaN: none did),
  with the largest load any sweep's timed plays ran beside."""
  sweeps = []
  for path in paths:
    with open(path) as f:
      sweeps.append(json.load(f))
  rows = []
  for i, row in enumerate(sweeps[0]["targets"]):
    values = [s["targets"][i]["speedup"][pair]["steps"] for s in sweeps]
    reached = [v for v in values if math.isfinite(v)]
    rows.append({"target": row["target"], "width": row["width"], "speedups": values,
                 "mean": float(np.mean(reached)) if reached else float("nan"), "reached": len(reached)})
  return {"sweeps": paths, "workdirs": [s["workdir"] for s in sweeps], "pair": pair, "rows": rows,
          "max_other_cores": max(max_other_cores(s["curves"]) for s in sweeps)}


def print_seed_summary(summary: dict, log=print) -> None:
  log(f"critical-step speedup {summary['pair']} to reach each target Item-F1, per trained seed "
      f"({len(summary['sweeps'])} sweeps: {', '.join(map(str, summary['workdirs']))}); mean over the seeds that reached it")
  log(f"{'target':>6s} {'W':>3s} {'per seed':>24s} {'mean':>6s}")
  for r in summary["rows"]:
    per_seed = " ".join(f"{v:6.2f}" if math.isfinite(v) else "     -" for v in r["speedups"])
    log(f"{r['target']:6.2f} {r['width']:3d} {per_seed:>24s} {r['mean']:6.2f}")


def model_measure(config, workdir: str, policies: list[str]):
  """measure_fn(policy, tasks) for the model policies (and the scripted ones), and each
  policy's training budget range."""
  model_cfg = config_utils.model_config_from(config.model)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  model = transformer.Transformer(model_cfg)
  restore = lambda path: trainer_lib.restore_params(model, path, mesh)   # the newest checkpoint's params (RL or SFT)
  with jax.set_mesh(mesh):
    trained = restore(workdir) if "swarm" in policies else None
    warm = restore(config.init.checkpoint or os.path.join(workdir, "warm_start"))
    sub = restore(config.parl.subagent_checkpoint) if config.parl.subagent_checkpoint else warm
  params = {"swarm": (trained, False), "single": (warm, True), "swarm (warm start)": (warm, False)}

  def measure_fn(name, tasks):
    if name in SCRIPTED:
      return measure_scripted(tasks, SCRIPTED[name])
    orch, solo = params[name]
    with jax.set_mesh(mesh):
      return measure(config, model_cfg, orch, sub, tasks, solo=solo)
  return measure_fn


def training_budgets(config) -> dict[str, tuple[int, int] | None]:
  rl, warm = tuple(config.parl.budget_range), tuple(config.warm_start.budget_range)
  return {"swarm": rl, "single": warm, "swarm (warm start)": warm, **{name: None for name in SCRIPTED}}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default=None, help="a finished configs/parl.py run (omit with --scripted: "
                      "the scripted references alone)")
  parser.add_argument("--widths", default="4,8,12,16,20,24")
  parser.add_argument("--budgets", default=",".join(str(b) for b in range(dsl.MIN_BUDGET, dsl.MAX_BUDGET + 1)))
  parser.add_argument("--tasks", type=int, default=24, help="held-out wide tasks per width")
  parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
  parser.add_argument("--targets", default="0.5,0.7,0.9")
  parser.add_argument("--warm_swarm", action="store_true", help="also the untrained (warm-start) swarm")
  parser.add_argument("--scripted", action="store_true", help="also the scripted single agent and swarm")
  parser.add_argument("--set", action="append", default=[], help="section.field=value config override")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "swarm_latency"))
  parser.add_argument("--summarize", default=None,
                      help="comma-separated saved sweeps (one per trained seed): print and write (to --out) "
                           "their speedups side by side instead of measuring")
  parser.add_argument("--pair", default="single / swarm", help="with --summarize: the speedup to summarize")
  args = parser.parse_args(argv)
  if args.summarize:
    summary = seed_summary(args.summarize.split(","), args.pair)
    print_seed_summary(summary)
    with open(args.out + ".json", "w") as f:
      json.dump(summary, f, indent=1)
    return summary
  if not args.workdir and not args.scripted:
    parser.error("--workdir is required (or --scripted for the references alone)")

  widths = [int(w) for w in args.widths.split(",")]
  budgets = [int(b) for b in args.budgets.split(",")]
  targets = [float(t) for t in args.targets.split(",")]
  for b in budgets:
    dsl.budget_id(b)                                   # raises unless a prompt can show it
  config = load_config()
  config_utils.apply_overrides(config, args.set)
  policies = ["swarm", "single", *(["swarm (warm start)"] if args.warm_swarm else [])] if args.workdir else []
  policies += list(SCRIPTED) if args.scripted else []
  start = time.perf_counter()
  if args.workdir:
    measure_fn = model_measure(config, args.workdir, policies)
  else:
    measure_fn = lambda name, tasks: measure_scripted(tasks, SCRIPTED[name])
  ranges = training_budgets(config)
  print(f"{args.tasks} held-out wide tasks per width (seed {args.seed}), greedy; * = a budget outside the policy's "
        f"training range (swarm: RL on {ranges['swarm']}, single / warm start: {ranges['single']})")
  curves = sweep(measure_fn, policies, widths, budgets, lambda w: wide_tasks(args.seed, w, args.tasks), ranges)
  table = target_table(curves, targets, widths)
  print_tables(table, curves)
  elapsed = time.perf_counter() - start
  max_load = max_other_cores(curves)
  print(f"elapsed {elapsed:.0f} s; other processes used up to {max_load:.2f} cores while a play was timed"
        + (f" (more than {interleave.MAX_LOAD}: the wall times measure the load, cite only critical steps)"
           if max_load > interleave.MAX_LOAD else ""))

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  source = os.path.abspath(args.workdir) if args.workdir else "scripted references"
  title = (f"{source}: {args.tasks} held-out wide tasks per width, widths {widths}, "
           f"budgets {budgets[0]}..{budgets[-1]}, greedy; swarm trained (RL) on budgets "
           f"{ranges['swarm'][0]}..{ranges['swarm'][1]}")
  plot(curves, table, targets, widths, args.out + ".png", title)
  with open(args.out + ".json", "w") as f:
    json.dump({"workdir": args.workdir and os.path.abspath(args.workdir), "tasks": args.tasks, "seed": args.seed,
               "widths": widths, "budgets": budgets, "targets_f1": targets, "tolerance": TOLERANCE,
               "training_budgets": ranges, "policies": policies, "curves": curves, "targets": table,
               "overrides": args.set, "elapsed_s": elapsed, "threads": len(os.sched_getaffinity(0)),
               "max_other_cores": max_load, "wall_times_loaded": max_load > interleave.MAX_LOAD,
               "jax": jax.__version__}, f, indent=1)
  print(f"wrote {args.out}.json and {args.out}.png")
  return curves, table


if __name__ == "__main__":
  main()
