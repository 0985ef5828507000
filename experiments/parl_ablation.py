"""Experiment: PARL's shaping rewards, annealed vs held constant vs off, from one warm start.

    python experiments/parl_ablation.py --workdir=DIR [--iterations 60 --seeds 0 --eval_every 10
        --out_dir /tmp/parl_ablation --out experiments/results/parl_ablation]
    python experiments/parl_ablation.py --from_json experiments/results/parl_ablation.json   # re-summarize, re-plot

DIR is a finished `configs/parl.py` run; its SFT warm start (DIR/warm_start) is copied
into a fresh workdir per run (out_dir/<variant>_s<seed>) and restored there through
`init.checkpoint`, so every run starts from the SAME params and nothing is retrained.
Then the PARL RL stage (`k25jax.stages.parl.run`, configs/parl.py defaults otherwise)
runs `--iterations` iterations (`train.steps`) with r = λ1 r_parallel + λ2 r_finish + r_perf:
* annealed: λ1, λ2 from the config's values to 0 over anneal_steps = round(anneal_fraction
            × iterations), by default the config's own fraction (anneal_steps / train.steps);
* constant: anneal_steps = 10**9 (`losses.anneal` clips t / total_steps to [0, 1], so
            λ stays within 1e-7 of its start value);
* zero:     λ1 = λ2 = 0 (r = Item-F1 alone).
`--seeds` sets train.seed (the training tasks and the orchestrator's state rng; the rollout
keys are the iteration's in every run, as in parl.run).

Reports, on the config's held-out tasks (at iteration 0, every --eval_every iterations and
at the last, as parl.run evaluates: the orchestrator sampled at rl.temperature with a
fixed seed; at the end both sampled and greedy) and per training iteration (the sampled
rollouts; `iteration_s` = their sample_s + train_s): Item-F1
(wide/deep), sub-agents created per episode (wide/deep), finish rate (Σ finished / Σ
assigned), critical steps; and classifies each final policy as the paper does:
* serial collapse: wide tasks with (almost) no sub-agents (< 0.5 per episode), or the
  width falling back to (within 0.5 of, or below) the minimum that fits the budget (mean over the held-out wide tasks
  of ceil(n / (B − 2)) for n ≥ B, the fewest sub-agents of `B − 2` steps each that cover
  n entities, 0 when the orchestrator alone can do them); also whether the width fell
  from its peak along training;
* spurious parallelism: spawning that does not pay: wide finish rate < 0.8 while spawning,
  sub-agents created but never assigned (> 10%), or spawning on deep tasks (≥ 0.5 per
  episode; a deep chain gains nothing from a sub-agent and loses a step).
Writes `<out>.json` (after every run, so a crash keeps the finished ones; each run's
result is also saved in its workdir and `--reuse` skips runs already done with the same
settings) and `<out>.png`. An iteration takes ~2–3 s on 2 cores, so a 60-iteration run
~3–4 minutes with its evaluations (plus ~1 minute of compilation in the first run); the
defaults (3 variants × 1 seed × 60 iterations) about 12 minutes.
"""
from __future__ import annotations

import argparse
import json
import logging as pylogging
import math
import os
import shutil
import time

import matplotlib
import numpy as np
from absl import logging

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from k25jax.agents import widesearch  # noqa: E402
from k25jax.stages import parl  # noqa: E402
from k25jax.train import config_utils  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
VARIANTS = ("annealed", "constant", "zero")
COLORS = {"annealed": "tab:blue", "constant": "tab:orange", "zero": "tab:green"}
MARKER = ".parl_ablation"     # marks a workdir this script made (and may delete)
FINAL = "swarm (trained)"      # parl.evaluate_all rows: "<name>, sampled" and "<name>, greedy"
FINAL_KEY = {"greedy": "final_greedy", "sampled": "final"}


def load_config():
  return config_utils.load_config_file(os.path.join(ROOT, "configs", "parl.py"), "tiny")



def anneal_fraction(args) -> float:
  """--anneal_fraction, or the config's own: anneal_steps / iterations."""
  if args.anneal_fraction is not None:
    return args.anneal_fraction
  config = load_config()
  config_utils.apply_overrides(config, args.set)
  return config.parl.anneal_steps / config.train.steps


def make_config(variant: str, seed: int, workdir: str, args):
  config = load_config()
  config_utils.apply_overrides(config, args.set)
  config.init.checkpoint = os.path.join(workdir, "warm_start")
  config.train.seed = seed
  config.train.steps = args.iterations
  config.train.eval_every = args.eval_every
  config.train.log_every = args.log_every
  config.train.checkpoint_every = args.iterations
  if args.eval_tasks:
    config.parl.eval_tasks = args.eval_tasks
  if variant == "annealed":
    config.parl.anneal_steps = max(1, round(anneal_fraction(args) * args.iterations))
  elif variant == "constant":
    config.parl.anneal_steps = 10**9
  elif variant == "zero":
    config.parl.lambda1 = config.parl.lambda2 = 0.0
  else:
    raise ValueError(f"variant {variant!r}; choose from {VARIANTS}")
  return config


def fresh_workdir(path: str, source: str) -> None:
  """A new workdir holding a copy of the source run's warm-start checkpoints."""
  if os.path.exists(path):
    if not os.path.exists(os.path.join(path, MARKER)):
      raise FileExistsError(f"{path} exists and was not made by this script; pass another --out_dir")
    shutil.rmtree(path)
  os.makedirs(path)
  open(os.path.join(path, MARKER), "w").close()
  shutil.copytree(os.path.join(source, "warm_start", "checkpoints"), os.path.join(path, "warm_start", "checkpoints"))


def min_fit_subagents(config) -> float:
  """Mean over the held-out wide tasks of the fewest sub-agents that cover the task within the budget."""
  b = config.parl.budget
  tasks = widesearch.sample_tasks(config.parl.eval_tasks, config.parl.eval_seed, deep_fraction=config.parl.deep_fraction)
  need = [0 if len(t.entities) <= b - 1 else math.ceil(len(t.entities) / (b - 2)) for t in tasks if t.kind == "wide"]
  return float(np.mean(need)) if need else 0.0


def point(row: dict) -> dict:
  """The metrics this experiment follows, from a parl.summarize row (eval, train or final)."""
  rate = lambda kind: row.get(f"{kind}/num_finished", 0.0) / row[f"{kind}/num_assigned"] if row.get(
      f"{kind}/num_assigned", 0.0) > 0 else float("nan")
  unassigned = (row["wide/num_created"] - row["wide/num_assigned"]) / row["wide/num_created"] if row.get(
      "wide/num_created", 0) > 0 else float("nan")
  out = {"item_f1": row["item_f1"], "wide_f1": row.get("wide/item_f1", float("nan")),
         "deep_f1": row.get("deep/item_f1", float("nan")), "wide_subagents": row.get("wide/num_created", float("nan")),
         "deep_subagents": row.get("deep/num_created", float("nan")), "wide_finish_rate": rate("wide"),
         "deep_finish_rate": rate("deep"), "finish_rate": row["num_finished"] / row["num_assigned"]
         if row["num_assigned"] > 0 else float("nan"), "wide_unassigned": unassigned,
         "critical_steps": row["critical_steps"], "wide_critical_steps": row.get("wide/critical_steps", float("nan")),
         "deep_critical_steps": row.get("deep/critical_steps", float("nan"))}
  for key in ("lambda1", "lambda2", "reward"):
    if key in row:
      out[key] = row[key]
  if "sample_s" in row and "train_s" in row:      # a training row: the iteration's rollouts and updates
    out["iteration_s"] = row["sample_s"] + row["train_s"]
  return out


def classify(final: dict, evals: list[dict], min_fit: float) -> dict:
  """Serial collapse and spurious parallelism labels of a final policy (module docstring)."""
  wide, peak = final["wide_subagents"], max([e["wide_subagents"] for e in evals] + [final["wide_subagents"]])
  if wide < 0.5:
    serial = "collapsed to ~0 sub-agents"
  elif wide < min_fit - 0.5:
    serial = f"below the minimum that fits the budget ({wide:.2f} < {min_fit:.2f})"
  elif wide <= min_fit + 0.5:
    serial = f"at the minimum that fits the budget ({wide:.2f} vs {min_fit:.2f})"
  else:
    serial = f"no ({wide:.2f} > minimum {min_fit:.2f})"
  if peak - wide >= 1.0:
    serial += f"; fell from a peak of {peak:.2f}"
  spurious = []
  if wide >= 0.5 and not final["wide_finish_rate"] >= 0.8:
    spurious.append(f"wide finish rate {final['wide_finish_rate']:.2f}")
  if final["wide_unassigned"] > 0.1:
    spurious.append(f"{100 * final['wide_unassigned']:.0f}% of wide sub-agents never assigned")
  if final["deep_subagents"] >= 0.5:
    spurious.append(f"{final['deep_subagents']:.2f} sub-agents on deep tasks")
  return {"serial_collapse": serial, "spurious_parallelism": "; ".join(spurious) or "no",
          "peak_wide_subagents": peak}


def final_row(rows: dict, name: str, mode: str) -> dict:
  """The final summary row of `name` decoded `mode` (sampled|greedy); older parl.run wrote greedy rows bare."""
  return rows.get(f"{name}, {mode}") or rows[name]


def run_one(variant: str, seed: int, args) -> dict:
  """One PARL run in a fresh workdir (or, with --reuse, the saved result of an identical earlier run)."""
  workdir = os.path.join(args.out_dir, f"{variant}_s{seed}")
  config = make_config(variant, seed, workdir, args)
  saved = os.path.join(workdir, "ablation_run.json")
  settings = {"source": os.path.abspath(args.workdir), "config": config.to_dict()}
  if args.reuse and os.path.exists(saved):
    with open(saved) as f:
      run = json.load(f)
    if run.get("settings") == json.loads(json.dumps(settings)):
      print(f"reusing {saved}")
      return run
  fresh_workdir(workdir, args.workdir)
  start = time.perf_counter()
  _, history = parl.run(config, workdir)
  elapsed = time.perf_counter() - start
  final = history[-1]["rows"]
  run = {"variant": variant, "seed": seed, "workdir": workdir, "elapsed_s": elapsed,
         "lambda1": config.parl.lambda1, "lambda2": config.parl.lambda2, "anneal_steps": config.parl.anneal_steps,
         "eval": [{"iteration": h["iteration"], **point(h)} for h in history if h["split"] == "eval"],
         "train": [{"iteration": h["iteration"], **point(h)} for h in history if h["split"] == "train"],
         "final": point(final_row(final, FINAL, "sampled")), "final_greedy": point(final_row(final, FINAL, "greedy")),
         "final_rows": final, "settings": settings}
  with open(saved, "w") as f:
    json.dump(run, f, indent=1)
  return run


def smooth(values, window: int = 5):
  v = np.asarray(values, float)
  return np.convolve(v, np.ones(window) / window, mode="valid") if len(v) >= window else v


def plot(runs: list[dict], min_fit: float, path: str, title: str) -> None:
  panels = (("wide_f1", "Item-F1, wide"), ("deep_f1", "Item-F1, deep"),
            ("wide_subagents", "sub-agents per episode, wide"), ("deep_subagents", "sub-agents per episode, deep"),
            ("wide_finish_rate", "finish rate (finished / assigned), wide"), ("critical_steps", "critical steps"))
  fig, axes = plt.subplots(2, 3, figsize=(15, 8))
  styles = ("-", "--", ":", "-.")
  seeds = sorted({r["seed"] for r in runs})
  for ax, (key, label) in zip(axes.flat, panels):
    for r in runs:
      color, ls = COLORS[r["variant"]], styles[seeds.index(r["seed"]) % len(styles)]
      evals = r["eval"] + [{"iteration": r["train"][-1]["iteration"], **r["final"]}]
      ax.plot([e["iteration"] for e in evals], [e[key] for e in evals], "o" + ls, color=color, ms=4,
              label=f"{r['variant']} s{r['seed']}")
      train = [t[key] for t in r["train"]]
      x = [t["iteration"] for t in r["train"]][len(r["train"]) - len(smooth(train)):]
      ax.plot(x, smooth(train), ls, color=color, alpha=0.35, lw=1)
    if key == "wide_subagents":
      ax.axhline(min_fit, color="k", lw=0.8, ls=":", label="minimum that fits the budget")
    ax.set_title(label, fontsize=10)
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
  axes.flat[2].legend(fontsize=7)
  fig.suptitle(title + "\nmarkers: held-out evals (orchestrator sampled, fixed seed, as parl.run logs them); "
               "faint: training rollouts (5-iteration mean)",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def summarize(result: dict) -> None:
  runs, min_fit = result["runs"], result["min_fit_subagents"]
  cols = (f"{'iter':>5s} {'F1':>6s} {'wide':>6s} {'deep':>6s} {'sub/ep wide':>11s} {'deep':>5s} "
          f"{'finish wide':>11s} {'crit.steps':>10s} {'λ1':>6s}")
  for r in runs:
    print(f"\n{r['variant']} (seed {r['seed']}, λ1 {r['lambda1']}, λ2 {r['lambda2']}, anneal_steps "
          f"{r['anneal_steps']}, {r['elapsed_s']:.0f} s): held-out evals along training (as parl.run logs them: "
          f"orchestrator sampled, fixed seed; the last row is the final sampled eval)")
    print(cols)
    train_lambda = {t["iteration"] - 1: t.get("lambda1", float("nan")) for t in r["train"]}
    for e in r["eval"] + [{"iteration": r["train"][-1]["iteration"], **r["final"]}]:
      print(f"{e['iteration']:5d} {e['item_f1']:6.3f} {e['wide_f1']:6.3f} {e['deep_f1']:6.3f} "
            f"{e['wide_subagents']:11.2f} {e['deep_subagents']:5.2f} {e['wide_finish_rate']:11.2f} "
            f"{e['critical_steps']:10.2f} {train_lambda.get(e['iteration'], float('nan')):6.3f}")
  for mode in ("greedy", "sampled"):
    print(f"\nfinal held-out metrics, orchestrator {mode} ({result['eval_tasks']} tasks, budget {result['budget']}); "
          f"minimum sub-agents that fit the budget on the wide tasks: {min_fit:.2f}")
    print(f"{'policy':>22s} {'F1':>6s} {'wide':>6s} {'deep':>6s} {'sub/ep wide':>11s} {'deep':>5s} "
          f"{'finish wide':>11s} {'crit.steps':>10s}  serial collapse / spurious parallelism")
    warm = result["warm_start"][mode]
    rows = [("warm start", warm, classify(warm, [], min_fit))] + [
        (f"{r['variant']} s{r['seed']}", r[FINAL_KEY[mode]], r["classification"][mode]) for r in runs]
    for name, f, c in rows:
      print(f"{name:>22s} {f['item_f1']:6.3f} {f['wide_f1']:6.3f} {f['deep_f1']:6.3f} {f['wide_subagents']:11.2f} "
            f"{f['deep_subagents']:5.2f} {f['wide_finish_rate']:11.2f} {f['critical_steps']:10.2f}  "
            f"{c['serial_collapse']} / {c['spurious_parallelism']}")
    single = result["single_agent"][mode]
    print(f"{'single agent (warm)':>22s} {single['item_f1']:6.3f} {single['wide_f1']:6.3f} {single['deep_f1']:6.3f} "
          f"{single['wide_subagents']:11.2f} {single['deep_subagents']:5.2f} {'-':>11s} "
          f"{single['critical_steps']:10.2f}")


def collect(runs: list[dict], args, elapsed: float) -> dict:
  """The result JSON: runs with their labels, the warm start's and the single agent's rows, the settings."""
  config = make_config("annealed", 0, args.out_dir, args)
  min_fit = min_fit_subagents(config)
  for r in runs:
    r["classification"] = {mode: classify(r[FINAL_KEY[mode]], r["eval"], min_fit) for mode in FINAL_KEY}
  rows = runs[0]["final_rows"]
  return {"source_workdir": os.path.abspath(args.workdir), "iterations": args.iterations,
          "anneal_fraction": anneal_fraction(args), "budget": config.parl.budget, "lambda1": config.parl.lambda1,
          "lambda2": config.parl.lambda2, "eval_tasks": config.parl.eval_tasks, "min_fit_subagents": min_fit,
          "overrides": args.set,
          "warm_start": {m: point(final_row(rows, "swarm (warm start)", m)) for m in FINAL_KEY},
          "single_agent": {m: point(final_row(rows, "single agent (warm start)", m)) for m in FINAL_KEY},
          "runs": runs, "elapsed_s": elapsed, "runs_elapsed_s": float(sum(r["elapsed_s"] for r in runs))}


class _Quiet(pylogging.Filter):
  def filter(self, record):
    return record.levelno >= pylogging.WARNING or not any(s in record.pathname for s in ("orbax", "xla_bridge"))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", help="a finished configs/parl.py run (its warm_start is reused)")
  parser.add_argument("--iterations", type=int, default=60)
  parser.add_argument("--seeds", default="0", help="comma-separated train.seed values")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--anneal_fraction", type=float, default=None,
                      help="annealed: anneal_steps = fraction × iterations (default: the config's own fraction)")
  parser.add_argument("--reuse", action="store_true", help="reuse runs already finished with the same settings")
  parser.add_argument("--eval_every", type=int, default=10)
  parser.add_argument("--eval_tasks", type=int, default=0, help="held-out tasks (0: the config's)")
  parser.add_argument("--log_every", type=int, default=10)
  parser.add_argument("--set", action="append", default=[], help="section.field=value config override (all runs)")
  parser.add_argument("--out_dir", default="/tmp/parl_ablation", help="the runs' workdirs")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "parl_ablation"))
  parser.add_argument("--from_json", default=None, help="re-summarize and re-plot a saved result")
  args = parser.parse_args()

  if args.from_json:
    with open(args.from_json) as f:
      result = json.load(f)
  else:
    if not args.workdir:
      parser.error("--workdir is required (or --from_json)")
    logging.set_verbosity(logging.INFO)
    pylogging.getLogger("absl").addFilter(_Quiet())
    start = time.perf_counter()
    runs = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for seed in [int(x) for x in args.seeds.split(",")]:
      for variant in args.variants.split(","):
        runs.append(run_one(variant, seed, args))
        result = collect(runs, args, time.perf_counter() - start)
        with open(args.out + ".json", "w") as f:      # after every run: a crash keeps the finished ones
          json.dump(result, f, indent=1)
  summarize(result)
  out = args.out if not args.from_json else os.path.splitext(args.from_json)[0]
  seeds = sorted({r["seed"] for r in result["runs"]})
  plot(result["runs"], result["min_fit_subagents"], out + ".png",
       f"PARL ablation from {result['source_workdir']}/warm_start: λ1/λ2 annealed, constant, zero; "
       f"{result['iterations']} iterations, seeds {seeds}")
  print(f"elapsed {result['elapsed_s']:.0f} s in this invocation; the runs took "
        f"{result.get('runs_elapsed_s', float('nan')):.0f} s")
  print(f"wrote {out}.json and {out}.png" if not args.from_json else f"wrote {out}.png")


if __name__ == "__main__":
  main()
