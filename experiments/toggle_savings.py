"""Experiment: Toggle's token savings at comparable accuracy (Kimi K2.5, token-efficient RL), tiny, on CPU.

    python experiments/toggle_savings.py [--seeds 3 --iterations 150 --rendering chat|compact
                                          --out experiments/results/toggle_savings]

For each seed s, two RL runs of `configs/rl.py:tiny` (`--rendering compact`: `:tiny,compact`,
the 17-token rendering of the addition task) from the SAME warm start (the
built-in SFT on 2-digit addition demonstrations, trained once per seed and copied into
both workdirs) with the same rollout keys and prompts per iteration: plain RL with the
K2.5 loss, and the same with Toggle on (`configs/toggle.py`: m, ρ, λ of the config).
Seed s sets `train.seed`, `warm_start.seed` and `task.seed` (so the training pool and the
held-out prompts change with the seed too). `--iterations` and `--eval_every` set
`train.steps` (RL iterations) and `train.eval_every`.

Reports, on the held-out prompts (sampled at T = 1, `rl.eval_samples` per prompt; greedy
accuracy as a secondary column): final accuracy, final mean response length, length of
the correct responses, Toggle's relative length reduction vs plain, and the first eval
iteration at which Toggle's mean length fell below plain's final one (also from the
per-iteration training rollouts, a finer but noisier clock). Also the mix of response
forms at the start and the end (completion lengths 4 bare / 10 scratch / 14 check /
20 both, EOS included) and Toggle's budgets, which say what there was to trim.
Writes `<out>.json` (curves, tables, config) and `<out>.png` (curves along training).

`--set section.field=value` (repeatable) overrides a config field in both runs, e.g.
`--set toggle.rho=30` or `--set warm_start.p_check=0.8`; toggle.* only acts on the Toggle run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import jax
import matplotlib
import numpy as np
from absl import logging

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from k25jax.model import transformer  # noqa: E402
from k25jax.rl import sampler  # noqa: E402
from k25jax.stages import rl  # noqa: E402
from k25jax.train import config_utils, sharding, trainer as trainer_lib  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RUNS = ("plain", "toggle")
FORMS = {4: "bare", 10: "scratch", 14: "check", 20: "both"}   # completion length (EOS included) → form


def make_config(run: str, seed: int, args):
  preset = "tiny" if args.rendering == "chat" else f"tiny,{args.rendering}"
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "rl.py"),
                                         f"{preset},toggle" if run == "toggle" else preset)
  config.train.seed = config.warm_start.seed = config.task.seed = seed
  config.train.steps = args.iterations
  config.train.eval_every = args.eval_every
  config_utils.apply_overrides(config, args.set)
  return config


def form_mix(config, params) -> dict:
  """Fractions of held-out samples by response form (length), correct ones only and all."""
  model_cfg = config_utils.model_config_from(config.model)
  task = rl.AdditionTask(config.task)
  sampling = sampler.SamplingConfig(max_new_tokens=task.max_new_tokens, temperature=config.rl.temperature,
                                    stop_tokens=task.stop_tokens, pad_id=task.render.pad_id)
  rows = np.arange(len(task.eval["tokens"]))
  out = rl.sample(model_cfg, params, task, task.eval, rows, 8, jax.random.PRNGKey(12345), sampling)
  mix = {}
  for length, name in FORMS.items():
    mix[name] = float(np.mean(out["length"] == length))
    mix[name + "_correct"] = float(np.mean((out["length"] == length) & out["correct"]))
  mix["accuracy"] = float(out["correct"].mean())
  return mix


def warm_start_diagnostics(config, workdir: str) -> dict:
  """The warm start's response mix and Toggle's budgets over the training pool (restored, not retrained)."""
  model_cfg = config_utils.model_config_from(config.model)
  model = transformer.Transformer(model_cfg)
  task = rl.AdditionTask(config.task)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  sampling = sampler.SamplingConfig(max_new_tokens=task.max_new_tokens, temperature=config.rl.temperature,
                                    stop_tokens=task.stop_tokens, pad_id=task.render.pad_id)
  with jax.set_mesh(mesh):
    params = (trainer_lib.restore_params(model, config.init.checkpoint, mesh) if config.init.checkpoint
              else rl.builtin_warm_start(config, model, task, mesh, workdir))
    budgets = rl.toggle_budgets(config, model_cfg, params, task, sampling)
    mix = form_mix(config, params)
  finite = budgets[np.isfinite(budgets)]
  return {"mix": mix, "budget_mean": float(finite.mean()), "budget_quantiles": {
      str(q): float(np.percentile(finite, q)) for q in (10, 25, 50, 75, 90)},
      "budget_below_10": float(np.mean(finite < 10)), "budget_10_to_14": float(np.mean((finite >= 10) & (finite < 14))),
      "budget_at_least_14": float(np.mean(finite >= 14))}


def run_one(run: str, seed: int, args) -> dict:
  config = make_config(run, seed, args)
  workdir = os.path.join(args.workdir, f"seed{seed}", run)
  cache = os.path.join(args.workdir, "warm_starts", rl.warm_start_key(config))
  shutil.rmtree(workdir, ignore_errors=True)        # fresh RL state: history must start at iteration 0
  os.makedirs(workdir)
  if os.path.isdir(cache):
    shutil.copytree(cache, os.path.join(workdir, "warm_start"))
  start = time.perf_counter()
  state, history = rl.run(config, workdir)
  seconds = time.perf_counter() - start
  if not os.path.isdir(cache):
    shutil.copytree(os.path.join(workdir, "warm_start"), cache)
  result = {"seconds": seconds, "config": config.to_dict(),
            "eval": [h for h in history if h["split"] == "eval"],
            "train": [{k: h.get(k) for k in ("iteration", "accuracy", "mean_length", "reward", "shaped_reward",
                                             "toggle_phase", "masked_fraction", "loss")}
                      for h in history if h["split"] == "train"],
            "final_mix": form_mix(config, state.params)}
  if run == "plain":
    result["warm_start"] = warm_start_diagnostics(config, workdir)
  return result


def first_below(rows: list[dict], threshold: float) -> int | None:
  """The first iteration whose mean length is below `threshold` (None if never)."""
  return next((r["iteration"] for r in rows if r["mean_length"] < threshold), None)


def summarize(seed_results: dict) -> dict:
  """Per seed: final eval metrics of both runs, Toggle's reduction and when it got there."""
  out = {}
  for seed, runs in seed_results.items():
    row = {}
    for run in RUNS:
      final = runs[run]["eval"][-1]
      row[run] = {k: final[k] for k in ("accuracy", "greedy_accuracy", "mean_length", "length_correct")}
    plain_final = row["plain"]["mean_length"]
    row["start"] = {k: runs["plain"]["eval"][0][k] for k in ("accuracy", "greedy_accuracy", "mean_length",
                                                             "length_correct")}
    row["same_start"] = runs["plain"]["eval"][0] == runs["toggle"]["eval"][0]
    row["length_reduction"] = 1.0 - row["toggle"]["mean_length"] / plain_final
    row["correct_length_reduction"] = 1.0 - row["toggle"]["length_correct"] / row["plain"]["length_correct"]
    row["accuracy_delta"] = row["toggle"]["accuracy"] - row["plain"]["accuracy"]
    train_length = {run: np.mean([r["mean_length"] for r in runs[run]["train"]]) for run in RUNS}
    row["rollout_token_reduction"] = float(1.0 - train_length["toggle"] / train_length["plain"])
    row["first_below_eval"] = first_below(runs["toggle"]["eval"], plain_final)
    row["first_below_train"] = first_below(runs["toggle"]["train"], plain_final)
    out[seed] = row
  return out


def mean_row(summary: dict) -> dict:
  rows = list(summary.values())
  mean = lambda f: float(np.mean([f(r) for r in rows]))
  out = {run: {k: mean(lambda r, run=run, k=k: r[run][k]) for k in rows[0][run]} for run in ("start",) + RUNS}
  for k in ("length_reduction", "correct_length_reduction", "accuracy_delta", "rollout_token_reduction"):
    out[k] = mean(lambda r, k=k: r[k])
  for k in ("first_below_eval", "first_below_train"):
    hits = [r[k] for r in rows if r[k] is not None]
    out[k] = float(np.mean(hits)) if hits else None
    out[k + "_seeds"] = len(hits)
  return out


def print_table(summary: dict, mean: dict) -> None:
  fmt_it = lambda v: "   never" if v is None else f"{v:8.0f}"
  print(f"\n{'seed':>5s} {'run':7s} {'acc':>6s} {'greedy':>7s} {'length':>7s} {'len ok':>7s} "
        f"{'Δlen %':>7s} {'Δacc':>6s} {'1st<plain (eval)':>17s} {'(train)':>8s} {'Δrollout tok %':>15s}")
  for seed, row in list(summary.items()) + [("mean", mean)]:
    print(f"{seed!s:>5s} {'start':7s} {row['start']['accuracy']:6.3f} {row['start']['greedy_accuracy']:7.3f} "
          f"{row['start']['mean_length']:7.2f} {row['start']['length_correct']:7.2f}")
    for run in RUNS:
      r = row[run]
      line = (f"{'':>5s} {run:7s} {r['accuracy']:6.3f} {r['greedy_accuracy']:7.3f} {r['mean_length']:7.2f} "
              f"{r['length_correct']:7.2f}")
      if run == "toggle":
        line += (f" {100 * row['length_reduction']:6.1f}% {row['accuracy_delta']:+6.3f} "
                 f"{fmt_it(row['first_below_eval']):>17s} {fmt_it(row['first_below_train'])} "
                 f"{100 * row['rollout_token_reduction']:14.1f}%")
      print(line)
  print("acc/greedy: held-out accuracy, sampled (T=1) / greedy; length: mean response tokens (EOS included); "
        "len ok: mean length of correct responses;\nΔlen: 1 − toggle/plain final mean length; "
        "1st<plain: first iteration where Toggle's length < plain's final (eval every "
        "`eval_every` iterations, or per-iteration training rollouts);\nΔrollout tok: 1 − toggle/plain tokens "
        "sampled over all training iterations. Mean row: means over seeds (first-below over the seeds that got "
        "there).")


def print_mix(seed_results: dict) -> None:
  print("\nresponse forms on the held-out prompts (fraction of 8 samples/prompt; bare 4 / scratch 10 / "
        "check 14 / both 20 tokens), and Toggle's budgets from the warm start")
  print(f"{'seed':>5s} {'policy':14s} {'bare':>6s} {'scratch':>8s} {'check':>6s} {'both':>6s} {'acc':>6s}")
  for seed, runs in seed_results.items():
    ws = runs["plain"]["warm_start"]
    for name, mix in (("warm start", ws["mix"]), ("plain final", runs["plain"]["final_mix"]),
                      ("toggle final", runs["toggle"]["final_mix"])):
      print(f"{seed!s:>5s} {name:14s} {mix['bare']:6.3f} {mix['scratch']:8.3f} {mix['check']:6.3f} "
            f"{mix['both']:6.3f} {mix['accuracy']:6.3f}")
    q = ws["budget_quantiles"]
    print(f"{'':>5s} budgets: mean {ws['budget_mean']:.2f}, quartiles {q['25']:.1f}/{q['50']:.1f}/{q['75']:.1f}; "
          f"< 10: {ws['budget_below_10']:.2f}, [10, 14): {ws['budget_10_to_14']:.2f}, "
          f">= 14: {ws['budget_at_least_14']:.2f}")


def plot(seed_results: dict, path: str) -> None:
  panels = (("accuracy", "held-out accuracy (sampled, T=1)"), ("greedy_accuracy", "held-out accuracy (greedy)"),
            ("mean_length", "mean response length (tokens)"), ("length_correct", "length of correct responses"))
  fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
  colors = {"plain": "tab:blue", "toggle": "tab:orange"}
  for (key, title), ax in zip(panels, axes.flat):
    for run in RUNS:
      curves = []
      for seed, runs in seed_results.items():
        rows = runs[run]["eval"]
        its, ys = [r["iteration"] for r in rows], [r[key] for r in rows]
        ax.plot(its, ys, color=colors[run], alpha=0.3, lw=0.8)
        curves.append(ys)
      ax.plot(its, np.mean(curves, axis=0), color=colors[run], lw=2.2, label=f"{run} (mean of {len(curves)} seeds)")
    ax.set(title=title)
    ax.grid(alpha=0.3)
  for ax in axes[1]:
    ax.set(xlabel="RL iteration")
  axes[0, 0].legend()
  fig.suptitle("RL with and without Toggle from the same warm start (tiny, 2-digit addition); thin: seeds")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
  parser.add_argument("--iterations", type=int, default=150, help="RL iterations (train.steps)")
  parser.add_argument("--eval_every", "--eval-every", type=int, default=10, help="train.eval_every")
  parser.add_argument("--set", action="append", default=[], help="section.field=value, for both runs")
  parser.add_argument("--rendering", choices=("chat", "compact"), default="chat",
                      help="the addition task's rendering (configs/rl.py: chat, or the compact switch)")
  parser.add_argument("--workdir", default="/tmp/k25jax_toggle_savings")
  parser.add_argument("--out", default="experiments/results/toggle_savings")
  parser.add_argument("--from_json", default="", help="re-summarize and re-plot a previous <out>.json, no training")
  args = parser.parse_args()
  logging.set_verbosity(logging.WARNING)

  if args.from_json:
    with open(args.from_json) as f:
      saved = json.load(f)
    seed_results = saved["runs"]
    summary = summarize(seed_results)
    print_table(summary, mean_row(summary))
    print_mix(seed_results)
    print(f"\n{saved['args']}, wall time {saved['wall_seconds'] / 60:.1f} min")
    plot(seed_results, args.out + ".png")
    return

  start = time.perf_counter()
  seed_results = {}
  for seed in range(args.seeds):
    seed_results[seed] = {}
    for run in RUNS:
      result = run_one(run, seed, args)
      seed_results[seed][run] = result
      first, last = result["eval"][0], result["eval"][-1]
      print(f"seed {seed} {run:6s}: accuracy {first['accuracy']:.3f} → {last['accuracy']:.3f}, "
            f"length {first['mean_length']:.2f} → {last['mean_length']:.2f}  ({result['seconds']:.0f} s)", flush=True)
  summary = summarize(seed_results)
  mean = mean_row(summary)
  print_table(summary, mean)
  print_mix(seed_results)
  seconds = time.perf_counter() - start
  print(f"\nwall time {seconds / 60:.1f} min")
  for seed, row in summary.items():
    if not row["same_start"]:
      print(f"WARNING: seed {seed}: the two runs' iteration-0 evals differ (not the same warm start?)")
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump({"args": vars(args), "wall_seconds": seconds, "summary": {str(k): v for k, v in summary.items()},
               "mean": mean, "runs": {str(k): v for k, v in seed_results.items()}}, f, indent=1)
  plot(seed_results, args.out + ".png")
  print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
  main()
