"""Experiment: PARL's shaping rewards (the λ ablation), annealed vs off vs r_parallel alone, from one warm start.

    python experiments/parl_ablation.py --workdir=DIR [--iterations 120 --seeds 0,1,2
        --variants annealed,zero,parallel_only --out_dir /tmp/parl_ablation
        --out experiments/results/parl_ablation --reuse]
    python experiments/parl_ablation.py --from_json experiments/results/parl_ablation.json   # re-analyze, re-plot

DIR is a finished `configs/parl.py` run; its SFT warm start (DIR/warm_start) is copied
into a fresh workdir per run (out_dir/<variant>_s<seed>) and restored there through
`init.checkpoint`, so every run starts from the SAME params and nothing is retrained.
Then the PARL RL stage (`k25jax.stages.parl.run`, configs/parl.py defaults otherwise)
runs `--iterations` iterations (default: the config's `train.steps`) with
r = λ1 r_parallel + λ2 r_finish + r_perf:
* annealed:      the config's λ1, λ2, annealed to 0 over anneal_steps = round(anneal_fraction
                 × iterations), by default the config's own fraction (anneal_steps / train.steps);
* zero:          λ1 = λ2 = 0 (r = Item-F1 alone);
* parallel_only: λ1 held at the config's value (anneal_steps = 10**9: `losses.anneal` clips
                 t / total_steps to [0, 1], so λ1 stays within 1e-7 of its start), λ2 = 0.
`--seeds` sets train.seed (the training tasks and the orchestrator's state rng; the rollout
keys are the iteration's in every run, as in parl.run).

Reports, on the config's held-out tasks (budgets drawn per task from parl.budget_range; at
iteration 0, every --eval_every iterations and at the last, as parl.run evaluates: the
orchestrator sampled at rl.temperature with a fixed seed; at the end both sampled and
greedy) and per training iteration (the sampled rollouts): Item-F1 (all, wide8plus = wide tasks
of 8..24 entities, deep), sub-agents created per episode (wide8plus, deep), unfinished
sub-tasks per episode ((assigned − finished) + created-never-assigned: r_finish's
denominator minus its numerator) and critical steps. Each final policy is labelled:
* serial collapse: wide8plus sub-agents per episode ≤ 1 (a wide task of 8+ entities done
  (almost) alone, though ≥ 2 sub-agents would cut its steps; the peak along training's
  held-out evals is reported beside it);
* spurious parallelism: unfinished sub-tasks and deep-task sub-agents per episode (a deep
  chain gains nothing from a sub-agent), each beside the annealed runs' mean.
Then a seed-mean table per variant and a verdict on the three effects the paper predicts:
(1) serial collapse without r_parallel: `zero` has wide8plus sub-agents ≤ 1 in at least 2 of 3
    seeds (⌈2n/3⌉ of n);
(2) spurious parallelism with r_parallel but no r_finish: `parallel_only` has measurably
    more unfinished sub-tasks or deep-task sub-agents per episode than `annealed`: seed
    means apart by at least max(0.25, 2 × the standard error of the difference);
(3) annealed is best on final Item-F1 (mean of seeds, strictly above the others),
each true/false with its numbers, for the greedy and the sampled final evaluation.
Writes `<out>.json` (after every run, so a crash keeps the finished ones; each run's
result is also saved in its workdir and `--reuse` skips runs already done with the same
settings; seed means and verdicts under "analysis") and `<out>.png`. Not timed on this
version of the stage: the whole configs/parl.py command (warm start included) was
estimated at ~15 minutes on 2 cores, so 9 runs of the default length take hours.
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

from k25jax.stages import parl  # noqa: E402
from k25jax.train import config_utils  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
VARIANTS = ("annealed", "zero", "parallel_only")
COLORS = {"annealed": "tab:blue", "zero": "tab:green", "parallel_only": "tab:orange"}
MARKER = ".parl_ablation"     # marks a workdir this script made (and may delete)
FINAL = "swarm (trained)"      # parl.evaluate_all rows: "<name>, sampled" and "<name>, greedy"
FINAL_KEY = {"greedy": "final_greedy", "sampled": "final"}
SERIAL_MAX = 1.0               # wide8plus sub-agents per episode at or below this: serial collapse
SPURIOUS_MARGIN = 0.25         # per episode: the least difference from annealed that counts as "more"
TABLE = (("item_f1", "F1"), ("wide8_f1", "wide8plus F1"), ("wide8_subagents", "wide8plus sub/ep"),
         ("deep_subagents", "deep sub/ep"), ("unfinished", "unfinished/ep"), ("critical_steps", "crit.steps"))
NAN = float("nan")


def base_config(args):
  """configs/parl.py (tiny) with the --set overrides."""
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "parl.py"), "tiny")
  config_utils.apply_overrides(config, args.set)
  return config


def anneal_fraction(args) -> float:
  """--anneal_fraction, or the config's own: anneal_steps / train.steps."""
  if args.anneal_fraction is not None:
    return args.anneal_fraction
  config = base_config(args)
  return config.parl.anneal_steps / config.train.steps


def make_config(variant: str, seed: int, workdir: str, args):
  config = base_config(args)
  config.init.checkpoint = os.path.join(workdir, "warm_start")
  config.train.seed = seed
  config.train.steps = args.iterations
  config.train.eval_every = args.eval_every or config.train.eval_every
  config.train.log_every = args.log_every
  config.train.checkpoint_every = args.iterations
  if args.eval_tasks:
    config.parl.eval_tasks = args.eval_tasks
  if variant == "annealed":
    config.parl.anneal_steps = max(1, round(anneal_fraction(args) * args.iterations))
  elif variant == "zero":
    config.parl.lambda1 = config.parl.lambda2 = 0.0
  elif variant == "parallel_only":
    config.parl.anneal_steps = 10**9
    config.parl.lambda2 = 0.0
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


# --------------------------------------------------------------------------------- metrics
def unfinished(row: dict, prefix: str = "") -> float:
  """Unfinished sub-tasks per episode: (assigned − finished) + created never assigned."""
  get = lambda name: row.get(prefix + name, NAN)
  return get("num_assigned") - get("num_finished") + get("num_idle")


def point(row: dict) -> dict:
  """The metrics this experiment follows, from a parl.summarize row (eval, train or final);
  NaN for a group the row has no task of."""
  get = lambda key: row.get(key, NAN)
  sub_tasks = get("num_assigned") + get("num_idle")
  out = {"item_f1": row["item_f1"], "wide_f1": get("wide/item_f1"), "wide8_f1": get("wide8plus/item_f1"),
         "deep_f1": get("deep/item_f1"), "wide_subagents": get("wide/num_created"),
         "wide8_subagents": get("wide8plus/num_created"), "deep_subagents": get("deep/num_created"),
         "unfinished": unfinished(row), "wide8_unfinished": unfinished(row, "wide8plus/"),
         "deep_unfinished": unfinished(row, "deep/"),
         "finish_rate": get("num_finished") / sub_tasks if sub_tasks > 0 else NAN,
         "critical_steps": row["critical_steps"], "wide8_critical_steps": get("wide8plus/critical_steps"),
         "deep_critical_steps": get("deep/critical_steps")}
  for key in ("lambda1", "lambda2", "reward", "r_parallel", "r_finish"):
    if key in row:
      out[key] = row[key]
  if "sample_s" in row and "train_s" in row:      # a training row: the iteration's rollouts and updates
    out["iteration_s"] = row["sample_s"] + row["train_s"]
  return out


def classify(final: dict, reference: dict | None = None, evals=()) -> dict:
  """Labels of one final policy (module docstring); `reference`: the annealed runs' mean point;
  `evals`: its held-out evals along training (their peak wide8plus width is reported beside)."""
  out = {"serial_collapse": bool(final["wide8_subagents"] <= SERIAL_MAX), "wide8_subagents": final["wide8_subagents"],
         "peak_wide8_subagents": float(np.nanmax([e.get("wide8_subagents", NAN) for e in evals]
                                                 + [final["wide8_subagents"], -np.inf])),
         "unfinished": final["unfinished"], "deep_subagents": final["deep_subagents"]}
  if reference is not None:
    out["unfinished_minus_annealed"] = final["unfinished"] - reference["unfinished"]
    out["deep_subagents_minus_annealed"] = final["deep_subagents"] - reference["deep_subagents"]
  return out


def seed_means(runs: list[dict], key: str) -> dict[str, dict]:
  """Per variant: the mean over seeds of each TABLE metric of the final point `key`, and the per-seed values."""
  out = {}
  for variant in dict.fromkeys(r["variant"] for r in runs):
    chosen = sorted((r for r in runs if r["variant"] == variant), key=lambda r: r["seed"])
    out[variant] = {"seeds": [r["seed"] for r in chosen]}
    for metric, _ in TABLE:
      values = [float(r[key].get(metric, NAN)) for r in chosen]
      out[variant][metric] = {"mean": float(np.mean(values)), "values": values}
  return out


def _stderr(values) -> float:
  return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def measurably_more(values: list[float], reference: list[float]) -> dict:
  """Whether mean(values) exceeds mean(reference) by at least max(SPURIOUS_MARGIN, 2 × the
  standard error of the difference of means); None when a value is NaN (no such task evaluated)."""
  diff = float(np.mean(values) - np.mean(reference))
  threshold = max(SPURIOUS_MARGIN, 2 * math.hypot(_stderr(values), _stderr(reference)))
  return {"more": bool(diff >= threshold) if math.isfinite(diff) else None, "difference": diff,
          "threshold": threshold}


def verdict(means: dict[str, dict]) -> dict:
  """The three expected effects (module docstring) from `seed_means`: each with `appeared`
  (True/False, None when a variant it needs was not run) and a sentence with the numbers."""
  out = {}
  if "zero" in means and not all(map(math.isfinite, means["zero"]["wide8_subagents"]["values"])):
    out["serial_collapse_without_r_parallel"] = {"appeared": None, "statement": "zero: no wide8plus task evaluated"}
  elif "zero" in means:
    values = means["zero"]["wide8_subagents"]["values"]
    collapsed = sum(v <= SERIAL_MAX for v in values)
    need = math.ceil(2 * len(values) / 3)
    ref = (f"; annealed mean {means['annealed']['wide8_subagents']['mean']:.2f}" if "annealed" in means else "")
    out["serial_collapse_without_r_parallel"] = {
        "appeared": bool(collapsed >= need), "seeds_collapsed": int(collapsed), "seeds": len(values),
        "needed": need, "wide8_subagents": values,
        "statement": f"zero: wide8plus sub-agents per episode ≤ {SERIAL_MAX:g} in {collapsed} of {len(values)} seeds "
                     f"(needed {need}; per seed {', '.join(f'{v:.2f}' for v in values)}{ref})"}
  else:
    out["serial_collapse_without_r_parallel"] = {"appeared": None, "statement": "zero was not run"}
  if "parallel_only" in means and "annealed" in means:
    parts, checks = [], {}
    for metric, name in (("unfinished", "unfinished sub-tasks"), ("deep_subagents", "deep-task sub-agents")):
      p, a = means["parallel_only"][metric], means["annealed"][metric]
      checks[metric] = {**measurably_more(p["values"], a["values"]), "parallel_only": p["mean"], "annealed": a["mean"]}
      c = checks[metric]
      label = {True: "more", False: "not more", None: "not measured"}[c["more"]]
      parts.append(f"{name} per episode {c['parallel_only']:.2f} vs annealed {c['annealed']:.2f} (difference "
                   f"{c['difference']:+.2f}, needed ≥ {c['threshold']:.2f}: {label})")
    found = [c["more"] for c in checks.values()]
    out["spurious_parallelism_without_r_finish"] = {
        "appeared": True if True in found else None if all(f is None for f in found) else False, **checks,
        "statement": "parallel_only: " + "; ".join(parts)}
  else:
    out["spurious_parallelism_without_r_finish"] = {"appeared": None,
                                                    "statement": "parallel_only or annealed was not run"}
  if "annealed" in means and len(means) > 1:
    f1 = {v: m["item_f1"]["mean"] for v, m in means.items()}
    best_other = max((v for v in f1 if v != "annealed"), key=lambda v: f1[v])
    out["annealed_best_final_f1"] = {
        "appeared": bool(f1["annealed"] > f1[best_other]), "item_f1": f1,
        "margin": f1["annealed"] - f1[best_other],
        "statement": "final Item-F1 (mean of seeds): " + ", ".join(f"{v} {x:.3f}" for v, x in f1.items())
                     + f" (annealed {'above' if f1['annealed'] > f1[best_other] else 'not above'} {best_other})"}
  else:
    out["annealed_best_final_f1"] = {"appeared": None, "statement": "annealed and another variant are needed"}
  return out


def analyze(runs: list[dict]) -> dict:
  """Per final mode (greedy, sampled): seed means per variant, each run's labels, the verdict."""
  analysis = {}
  for mode, key in FINAL_KEY.items():
    means = seed_means(runs, key)
    reference = {m: means["annealed"][m]["mean"] for m, _ in TABLE} if "annealed" in means else None
    analysis[mode] = {"seed_means": means, "verdict": verdict(means),
                      "classification": {f"{r['variant']}_s{r['seed']}": classify(r[key], reference, r.get("eval", ()))
                                         for r in runs}}
  return analysis


# ------------------------------------------------------------------------------------- runs
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


def collect(runs: list[dict], args, elapsed: float) -> dict:
  """The result JSON: runs, the warm start's and the single agent's rows, the analysis, the settings."""
  config = make_config("annealed", 0, args.out_dir, args)
  rows = runs[0]["final_rows"]
  return {"source_workdir": os.path.abspath(args.workdir), "iterations": args.iterations,
          "anneal_fraction": anneal_fraction(args), "budget_range": list(config.parl.budget_range),
          "n_range": list(config.parl.n_range), "lambda1": config.parl.lambda1, "lambda2": config.parl.lambda2,
          "eval_tasks": config.parl.eval_tasks, "overrides": args.set,
          "warm_start": {m: point(final_row(rows, "swarm (warm start)", m)) for m in FINAL_KEY},
          "single_agent": {m: point(final_row(rows, "single agent (warm start)", m)) for m in FINAL_KEY},
          "runs": runs, "analysis": analyze(runs), "elapsed_s": elapsed,
          "runs_elapsed_s": float(sum(r["elapsed_s"] for r in runs))}


# ------------------------------------------------------------------------------- reporting
def smooth(values, window: int = 5):
  """A trailing mean over `window` values, skipping NaN (a group absent from an iteration)."""
  v = np.asarray(values, float)
  if len(v) < window:
    return v
  ok = np.isfinite(v)
  total = np.convolve(np.where(ok, v, 0.0), np.ones(window), mode="valid")
  count = np.convolve(ok.astype(float), np.ones(window), mode="valid")
  return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def plot(runs: list[dict], path: str, title: str) -> None:
  panels = (("wide8_f1", "Item-F1, wide8plus (8-24 entities)"), ("deep_f1", "Item-F1, deep"),
            ("wide8_subagents", "sub-agents per episode, wide8plus"), ("deep_subagents", "sub-agents per episode, deep"),
            ("unfinished", "unfinished sub-tasks per episode"), ("critical_steps", "critical steps"))
  fig, axes = plt.subplots(2, 3, figsize=(15, 8))
  styles = ("-", "--", ":", "-.")
  seeds = sorted({r["seed"] for r in runs})
  for ax, (key, label) in zip(axes.flat, panels):
    for r in runs:
      color, ls = COLORS.get(r["variant"]), styles[seeds.index(r["seed"]) % len(styles)]
      evals = r["eval"] + [{"iteration": r["train"][-1]["iteration"], **r["final"]}]
      ax.plot([e["iteration"] for e in evals], [e.get(key, NAN) for e in evals], "o" + ls, color=color, ms=4,
              label=f"{r['variant']} s{r['seed']}")
      train = [t.get(key, NAN) for t in r["train"]]
      x = [t["iteration"] for t in r["train"]][len(r["train"]) - len(smooth(train)):]
      ax.plot(x, smooth(train), ls, color=color, alpha=0.35, lw=1)
    if key == "wide8_subagents":
      ax.axhline(SERIAL_MAX, color="k", lw=0.8, ls=":", label=f"serial collapse (≤ {SERIAL_MAX:g})")
    ax.set_title(label, fontsize=10)
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
  axes.flat[2].legend(fontsize=7)
  fig.suptitle(title + "\nmarkers: held-out evals (orchestrator sampled, fixed seed, as parl.run logs them); "
               "faint: training rollouts (5-iteration mean)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _row(name: str, f: dict, note: str = "") -> str:
  return f"{name:>24s}" + "".join(f" {f.get(k, NAN):>13.3f}" for k, _ in TABLE) + (f"  {note}" if note else "")


def summarize(result: dict) -> None:
  runs, analysis = result["runs"], result["analysis"]
  for r in runs:
    print(f"\n{r['variant']} (seed {r['seed']}, λ1 {r['lambda1']}, λ2 {r['lambda2']}, anneal_steps "
          f"{r['anneal_steps']}, {r['elapsed_s']:.0f} s): held-out evals along training (as parl.run logs them: "
          f"orchestrator sampled, fixed seed; the last row is the final sampled eval)")
    print(f"{'iter':>5s}" + "".join(f" {label:>13s}" for _, label in TABLE) + f" {'λ1':>6s}")
    train_lambda = {t["iteration"] - 1: t.get("lambda1", NAN) for t in r["train"]}
    for e in r["eval"] + [{"iteration": r["train"][-1]["iteration"], **r["final"]}]:
      print(f"{e['iteration']:5d}" + "".join(f" {e.get(k, NAN):13.3f}" for k, _ in TABLE)
            + f" {train_lambda.get(e['iteration'], NAN):6.3f}")
  header = f"{'policy':>24s}" + "".join(f" {label:>13s}" for _, label in TABLE)
  for mode in FINAL_KEY:
    a = analysis[mode]
    budgets = result.get("budget_range") or [result.get("budget")] * 2      # older results: one budget
    print(f"\nfinal held-out metrics, orchestrator {mode} ({result['eval_tasks']} tasks, budgets "
          f"{budgets[0]}-{budgets[1]} drawn per task); labels: serial collapse = wide8plus "
          f"sub-agents ≤ {SERIAL_MAX:g}; unfinished and deep sub-agents vs the annealed mean")
    print(header)
    print(_row("warm start", result["warm_start"][mode]))
    print(_row("single agent (warm)", result["single_agent"][mode]))
    for r in runs:
      c = a["classification"][f"{r['variant']}_s{r['seed']}"]
      note = (f"serial collapse: {'yes' if c['serial_collapse'] else 'no'} (peak along training "
              f"{c['peak_wide8_subagents']:.2f}); unfinished "
              f"{c.get('unfinished_minus_annealed', NAN):+.2f}, deep sub-agents "
              f"{c.get('deep_subagents_minus_annealed', NAN):+.2f} vs annealed")
      print(_row(f"{r['variant']} s{r['seed']}", r[FINAL_KEY[mode]], note))
    print(f"\nseed means ({mode}):")
    print(header)
    for variant, m in a["seed_means"].items():
      print(_row(f"{variant} ({len(m['seeds'])} seeds)", {k: m[k]["mean"] for k, _ in TABLE}))
    print(f"\nverdict ({mode}):")
    for name, v in a["verdict"].items():
      print(f"  {name}: {v['appeared']}  {v['statement']}")


class _Quiet(pylogging.Filter):
  def filter(self, record):
    return record.levelno >= pylogging.WARNING or not any(s in record.pathname for s in ("orbax", "xla_bridge"))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", help="a finished configs/parl.py run (its warm_start is reused)")
  parser.add_argument("--iterations", type=int, default=None, help="RL iterations per run (default: train.steps)")
  parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--anneal_fraction", type=float, default=None,
                      help="annealed: anneal_steps = fraction × iterations (default: the config's own fraction)")
  parser.add_argument("--reuse", action="store_true", help="reuse runs already finished with the same settings")
  parser.add_argument("--eval_every", type=int, default=None, help="default: the config's train.eval_every")
  parser.add_argument("--eval_tasks", type=int, default=0, help="held-out tasks (0: the config's)")
  parser.add_argument("--log_every", type=int, default=10)
  parser.add_argument("--set", action="append", default=[], help="section.field=value config override (all runs)")
  parser.add_argument("--out_dir", default="/tmp/parl_ablation", help="the runs' workdirs")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "parl_ablation"))
  parser.add_argument("--from_json", default=None, help="re-summarize and re-plot a saved result")
  args = parser.parse_args(argv)

  if args.from_json:
    with open(args.from_json) as f:
      result = json.load(f)
    for r in result["runs"]:          # the final points again from the raw rows, in this version's terms
      if "final_rows" in r:
        r["final"] = point(final_row(r["final_rows"], FINAL, "sampled"))
        r["final_greedy"] = point(final_row(r["final_rows"], FINAL, "greedy"))
    result["analysis"] = analyze(result["runs"])
    with open(args.from_json, "w") as f:
      json.dump(result, f, indent=1)
  else:
    if not args.workdir:
      parser.error("--workdir is required (or --from_json)")
    for variant in args.variants.split(","):
      if variant not in VARIANTS:
        parser.error(f"variant {variant!r}; choose from {VARIANTS}")
    if args.iterations is None:
      args.iterations = base_config(args).train.steps
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
  plot(result["runs"], out + ".png",
       f"PARL λ ablation from {result['source_workdir']}/warm_start: annealed, zero, parallel_only (λ1 constant, "
       f"λ2 = 0); {result['iterations']} iterations, seeds {seeds}")
  print(f"elapsed {result['elapsed_s']:.0f} s in the invocation that ran them; the runs took "
        f"{result.get('runs_elapsed_s', NAN):.0f} s")
  print(f"wrote {out}.json and {out}.png" if not args.from_json else f"wrote {out}.json (analysis) and {out}.png")
  return result


if __name__ == "__main__":
  main()
