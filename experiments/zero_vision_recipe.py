"""Experiment: Fig. 2's claim (zero-vision SFT activates vision RL better than text+vision SFT)
on the recipe's base, with seeds.

    python experiments/zero_vision_recipe.py [--root runs/zero_vision_recipe] [--seeds 0,1,2]
        [--arms zero_vision,text_vision,no_sft] [--out experiments/results/zero_vision_recipe]
        [--set stage.section.field=value ...]

The base is the recipe's mid-trained K2.5 model (`experiments/recipe.py`'s first four stages,
text pre-training → ViT → joint pre-training → mid-training, in `<root>/base`; one base for
every seed). From it, per seed, three arms with the recipe's SFT replay (500 rows of
pre-training text, 3,000 joint pre-training image samples):

    zero_vision   the recipe's SFT (configs/recipe.py: configs/sft.py:tiny,arithmetic): text-only
                  tool trajectories and addition chats, no SFT example with an image
    text_vision   the same + 3,000 image → direct-answer examples (data.visual_sft), in twice the
                  image rows a step (train.visual_batch 8), so the replay keeps its share
    no_sft        the base itself

then the same vision RL from each (configs/rl.py:vision, the sandboxed Python tool available,
30 iterations, the recipe's model with mid-training's YaRN rope). A seed sets the SFT's data
and training seeds and the RL's sampling seed; the held-out tasks are the same for every seed.

Reports per arm, mean ± standard error over the seeds: the SFT's held-out image + tool accuracy
and tool-call success (greedy), and along RL the held-out sampled accuracy and tool-call success;
the paired differences of the arms' final RL accuracy, and the verdict on the claim
(zero-vision − text+vision beyond 2 standard errors: reproduced or refuted; else not
distinguishable from noise). A finished run (its result file) is reused, so the command
resumes, and processes with disjoint `--seeds`/`--arms` can share one root; the last one run
with every seed and arm writes `<out>.json`, `.txt` and `.png`.
`--set` overrides a stage's field: stage one of base stages (text_pretrain, vit,
joint_pretrain, midtrain), sft or rl, e.g. `--set rl.train.steps=20`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import matplotlib
from absl import logging

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import recipe  # noqa: E402
import seed_stats  # noqa: E402
import zero_vision  # noqa: E402
from configs import rl as rl_configs  # noqa: E402
from k25jax.train import config_utils  # noqa: E402

ARMS = ("zero_vision", "text_vision", "no_sft")
BASE_STAGES = recipe.STAGES[:recipe.STAGES.index("midtrain") + 1]
CLAIM = ("zero_vision", "text_vision")   # Fig. 2: the first activates vision RL better than the second


def split_overrides(items: list[str]) -> tuple[tuple[str, ...], dict[str, list[str]]]:
  """(--set items of the base stages, as recipe.stage_configs takes them; {"sft"|"rl": fields})."""
  base, rest = [], {"sft": [], "rl": []}
  for item in items:
    stage, _, field = item.partition(".")
    if stage in BASE_STAGES:
      base.append(item)
    elif stage in rest:
      rest[stage].append(field)
    else:
      raise ValueError(f"--set {item!r}: the stage is one of {BASE_STAGES + ('sft', 'rl')}")
  return tuple(base), rest


def sft_config(arm: str, seed: int, base_dir: str, args):
  """The recipe's SFT config from the base (text+vision: + the image → answer examples), at `seed`."""
  config = recipe.stage_configs("tiny", args.base_overrides)["sft"]
  if arm == "text_vision":
    config.data.visual_sft = True
    config.train.visual_batch *= 2
  config.data.seed = config.train.seed = seed
  config.eval.settings = "text_tool,image_tool"    # Fig. 2's setting, and whether the tool use was learnt at all
  recipe.init_from(config, base_dir)
  config_utils.apply_overrides(config, args.overrides["sft"])
  return config


def rl_config(start_dir: str, seed: int, args):
  """configs/rl.py:vision on the recipe's model (mid-training's rope), from `start_dir`, at `seed`."""
  config = rl_configs.get_config("vision")
  config.model = recipe.stage_configs("tiny", args.base_overrides)["joint_rl"].model
  config.train.seed = seed
  recipe.init_from(config, start_dir)
  config_utils.apply_overrides(config, args.overrides["rl"])
  return config


def run_sft(arm: str, seed: int, base_dir: str, args) -> tuple[str, dict]:
  """(the SFT's workdir, its held-out evaluation: {setting: {accuracy, tool_call_success, ...}})."""
  workdir = os.path.join(args.root, f"seed{seed}", arm)
  return workdir, zero_vision.sft_results(sft_config(arm, seed, base_dir, args), workdir)


def run_rl(arm: str, seed: int, start_dir: str, args) -> dict:
  """{"history": the RL's logged rows, "minutes"}; the eval rows carry the held-out metrics."""
  return zero_vision.rl_curves(rl_config(start_dir, seed, args), os.path.join(args.root, f"seed{seed}", "rl", arm))


def run_arm(arm: str, seed: int, base_dir: str, args) -> dict:
  """One arm at one seed: {"sft": its image + tool evaluation or None, "evals": RL's eval rows}."""
  start_dir, sft_eval = (base_dir, None) if arm == "no_sft" else run_sft(arm, seed, base_dir, args)
  curves = run_rl(arm, seed, start_dir, args)
  evals = [h for h in curves["history"] if h["split"] == "eval"]
  return {"sft": sft_eval["image_tool"] if sft_eval else None, "evals": evals, "rl_minutes": curves["minutes"]}


# ------------------------------------------------------------------------------- report
def summarize(runs: dict[str, dict[int, dict]]) -> dict:
  """Per arm, mean ± s.e. over seeds of the SFT's and the RL's start and final held-out metrics;
  the paired differences of the final RL accuracy; the claim's verdict."""
  seeds = sorted(next(iter(runs.values())))
  arms = {}
  for arm, by_seed in runs.items():
    per_seed = {
        "sft_accuracy": [by_seed[s]["sft"]["accuracy"] if by_seed[s]["sft"] else None for s in seeds],
        "sft_tool_call_success": [by_seed[s]["sft"]["tool_call_success"] if by_seed[s]["sft"] else None
                                  for s in seeds],
        "rl_start_accuracy": [by_seed[s]["evals"][0]["accuracy"] for s in seeds],
        "rl_final_accuracy": [by_seed[s]["evals"][-1]["accuracy"] for s in seeds],
        "rl_final_tool_call_success": [by_seed[s]["evals"][-1]["tool_call_success"] for s in seeds]}
    arms[arm] = {"per_seed": per_seed,
                 "mean_and_error": {k: seed_stats.mean_and_error(v) for k, v in per_seed.items() if None not in v}}
  names = list(runs)
  pairs = {f"{a} vs {b}": seed_stats.paired_difference(arms[a]["per_seed"]["rl_final_accuracy"],
                                                       arms[b]["per_seed"]["rl_final_accuracy"], True, (a, b))
           for i, a in enumerate(names) for b in names[i + 1:]}
  return {"seeds": seeds, "arms": arms, "pairs": pairs, "verdict": verdict(pairs.get(" vs ".join(CLAIM)))}


def verdict(pair: dict | None) -> str:
  """One sentence on Fig. 2's claim from the paired difference zero-vision − text+vision."""
  if pair is None:
    return "not run (both the zero_vision and the text_vision arm are needed)"
  difference = f"final RL accuracy zero-vision − text+vision {pair['mean']:+.3f} ± {pair['error']:.3f}"
  if not pair["exceeds_noise"]:
    return f"not distinguishable from noise at this scale ({difference}, within 2 standard errors)"
  held = pair["better"] == CLAIM[0]
  return f"{'reproduced' if held else 'refuted'} at this scale ({difference}, beyond 2 standard errors)"


def table(summary: dict) -> str:
  # "–": no SFT, or (NaN) an arm that made no tool call in some seed
  cells = lambda stats, key: "–" if key not in stats or stats[key][0] != stats[key][0] else \
      f"{stats[key][0]:.3f} ± {stats[key][1]:.3f}"
  keys = ("sft_accuracy", "sft_tool_call_success", "rl_start_accuracy", "rl_final_accuracy",
          "rl_final_tool_call_success")
  lines = [f"{len(summary['seeds'])} seeds {summary['seeds']}: mean ± standard error (held-out image + tool tasks)",
           "", "| arm | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
  lines += [f"| {arm} | " + " | ".join(cells(a["mean_and_error"], k) for k in keys) + " |"
            for arm, a in summary["arms"].items()]
  lines += ["", "Per seed (final RL accuracy): " + "; ".join(
      f"{arm} " + ", ".join(f"{v:.3f}" for v in a["per_seed"]["rl_final_accuracy"])
      for arm, a in summary["arms"].items()), "", "Paired differences of the final RL accuracy:"]
  lines += [f"* {name}: {p['mean']:+.3f} ± {p['error']:.3f}{' (beyond 2 s.e.)' if p['exceeds_noise'] else ''}"
            for name, p in summary["pairs"].items()]
  lines += ["", f"Fig. 2's claim: {summary['verdict']}."]
  return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict[int, dict]], path: str) -> None:
  """Held-out accuracy and tool-call success along RL: each seed thin, the mean over seeds thick."""
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  for ax, key in zip(axes, ("accuracy", "tool_call_success")):
    for i, (arm, by_seed) in enumerate(runs.items()):
      color = f"C{i}"
      curves = [[(h["iteration"], h[key]) for h in run["evals"]] for run in by_seed.values()]
      for curve in curves:
        ax.plot(*zip(*curve), color=color, alpha=0.3, lw=1)
      its = [it for it, _ in curves[0]]
      mean = [sum(c[j][1] for c in curves) / len(curves) for j in range(len(its))]
      ax.plot(its, mean, color=color, lw=2.5, marker="o", label=arm)
    ax.set_xlabel("vision RL iteration")
    ax.set_ylabel(f"held-out {key.replace('_', ' ')}")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle("Fig. 2 on the recipe's mid-trained base: vision RL from each SFT arm (thin: seeds)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--root", default="runs/zero_vision_recipe")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "zero_vision_recipe"))
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--set", action="append", default=[], metavar="STAGE.SECTION.FIELD=VALUE")
  args = parser.parse_args()
  args.base_overrides, args.overrides = split_overrides(args.set)
  seeds = [int(s) for s in args.seeds.split(",") if s]
  arms = [a for a in args.arms.split(",") if a]
  if not seeds or not arms or set(arms) - set(ARMS):
    raise ValueError(f"--seeds {args.seeds!r} --arms {args.arms!r}: seeds are integers, arms some of {ARMS}")
  logging.set_verbosity(logging.INFO)
  start = time.time()
  recipe.run_chain("tiny", os.path.join(args.root, "base"), None, args.base_overrides, last=BASE_STAGES[-1])
  base_dir = os.path.join(args.root, "base", BASE_STAGES[-1])
  runs = {arm: {seed: run_arm(arm, seed, base_dir, args) for seed in seeds} for arm in arms}
  if len(seeds) < 2:
    logging.info("zero_vision_recipe: one seed run; the report needs two or more")
    return
  summary = summarize(runs)
  summary.update(set=args.set, wall_s=time.time() - start,
                 rl_minutes={arm: [r["rl_minutes"] for r in by_seed.values()] for arm, by_seed in runs.items()},
                 curves={arm: {str(s): r["evals"] for s, r in by_seed.items()} for arm, by_seed in runs.items()})
  text = table(summary)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump(summary, f, indent=1)
  with open(args.out + ".txt", "w") as f:
    f.write(text)
  plot(runs, args.out + ".png")
  print(text)
  print(f"wrote {args.out}.json, .txt and .png")


if __name__ == "__main__":
  main()
