"""Experiment: RL on open descriptions with a generative reward model (GRM), against the hidden
rubric it stands in for; tiny, on CPU.

    python experiments/grm_rl.py --judge runs/grm [--root /tmp/grm_rl] [--out experiments/results/grm_rl]
                                 [--seeds 0,1,2] [--set stage.section.field=value ...]

    judge   a workdir of configs/grm.py (the judge: SFT on judgements of descriptions), given
    sft     configs/sft.py:tiny,describe, short: the policy that describes scenes some of the time
    rl/<reward>/seed<k>   configs/rl.py:joint,describe on descriptions alone from that one SFT
            start, 40 iterations of 16 prompts × 8 samples at lr 5e-5 (the preset's 2e-4 lowered
            the held-out rubric even with the rubric as the reward): reward `grm` (the judge's
            verdict, the mean of 4 judgements) or `rubric` (the hidden truth itself, the upper
            bound), the same seeds

Along RL, per iteration: the judge's reward and the hidden rubric of the training episodes
(their gap: hacking shows as a GRM reward that rises while the rubric does not), and at each
evaluation the held-out rubric (sampled and greedy episodes). Reports the held-out rubric at
the start and the end per arm (mean ± standard error over seeds), and the judge's share of an
iteration's time. Writes `<out>.json` and `<out>.png`. `--set`: `--set rl.train.steps=20`,
`--set sft.train.steps=200`, `--set rl.grm.samples=4`. Finished stages are reused.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import matplotlib
import numpy as np
from absl import logging

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from k25jax.stages import rl_vision, sft  # noqa: E402
from zero_vision import load  # noqa: E402  (a stage's config with its --set overrides)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
REWARDS = ("grm", "rubric")
RUBRIC = "visual_description/rubric"
GREEDY_RUBRIC = "greedy_visual_description/rubric"


def sft_config(args):
  """A short SFT: the zero-vision trajectories beside 3,000 descriptions; held out, direct image answers."""
  return load("sft.py", "tiny,describe", "sft", args, defaults=(
      "data.trajectories=500", "train.steps=300", "train.eval_every=300", "train.checkpoint_every=300",
      "eval.tasks=16", "eval.settings=image_no_tool"))


def rl_config(reward: str, seed: int, sft_dir: str, args):
  config = load("rl.py", "joint,describe", "rl", args, defaults=(
      "task.kinds=describe", f"rl.describe_reward={reward}", f"train.seed={seed}", "train.steps=40",
      "train.eval_every=20", "train.checkpoint_every=40", "task.eval_prompts=32", "rl.prompts_per_iteration=16",
      "optimizer.lr=5e-5", "grm.samples=4"))
  config.init.checkpoint = sft_dir
  config.grm.checkpoint = args.judge if reward == "grm" else ""     # the rubric arm needs no judge
  return config


def run_sft(args) -> str:
  workdir = os.path.join(args.root, "sft")
  if not os.path.exists(os.path.join(workdir, "sft_eval.json")):
    t0 = time.perf_counter()
    sft.run(sft_config(args), workdir)
    logging.info("grm_rl: the policy's SFT took %.1f min", (time.perf_counter() - t0) / 60)
  return workdir


def run_rl(reward: str, seed: int, sft_dir: str, args) -> list[dict]:
  workdir = os.path.join(args.root, "rl", reward, f"seed{seed}")
  path = os.path.join(workdir, "curves.json")
  if not os.path.exists(path):
    t0 = time.perf_counter()
    _, history = rl_vision.run(rl_config(reward, seed, sft_dir, args), workdir)
    curves = [{k: v for k, v in h.items() if isinstance(v, (int, float, str))} for h in history]
    with open(path, "w") as f:
      json.dump({"history": curves, "minutes": (time.perf_counter() - t0) / 60}, f, indent=1)
  with open(path) as f:
    return json.load(f)["history"]


def _mean_se(values) -> dict:
  v = np.asarray(values, np.float64)
  return {"mean": float(v.mean()), "se": float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0,
          "values": [float(x) for x in v]}


def summarize(curves: dict) -> dict:
  """Per reward arm over seeds: held-out rubric (sampled, greedy) at the start and the end, the
  training episodes' judge reward and rubric over the last quarter of iterations (their gap),
  and the judge's share of an iteration's time."""
  out = {}
  for reward, by_seed in curves.items():
    evals = {s: [h for h in hist if h["split"] == "eval"] for s, hist in by_seed.items()}
    train = {s: [h for h in hist if h["split"] == "train"] for s, hist in by_seed.items()}
    tail = {s: rows[-max(1, len(rows) // 4):] for s, rows in train.items()}
    row = {"start_rubric": _mean_se([e[0][RUBRIC] for e in evals.values()]),
           "final_rubric": _mean_se([e[-1][RUBRIC] for e in evals.values()]),
           "start_greedy_rubric": _mean_se([e[0][GREEDY_RUBRIC] for e in evals.values()]),
           "final_greedy_rubric": _mean_se([e[-1][GREEDY_RUBRIC] for e in evals.values()]),
           "train_rubric_last_quarter": _mean_se([np.mean([h[RUBRIC] for h in t]) for t in tail.values()])}
    if all("visual_description/grm_reward" in h for t in tail.values() for h in t):
      row["train_grm_reward_last_quarter"] = _mean_se(
          [np.mean([h["visual_description/grm_reward"] for h in t]) for t in tail.values()])
      row["train_gap_last_quarter"] = _mean_se([np.mean([h["visual_description/gap"] for h in t])
                                                for t in tail.values()])
      row["judge_share_of_iteration"] = _mean_se(
          [np.mean([h["grm_s"] / (h["sample_s"] + h["train_s"]) for h in t]) for t in train.values()])
    out[reward] = row
  return out


def plot(curves: dict, path: str) -> None:
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  colours = {"grm": "tab:blue", "rubric": "tab:green"}
  for reward, by_seed in curves.items():
    for k, history in enumerate(by_seed.values()):
      train = [h for h in history if h["split"] == "train"]
      evals = [h for h in history if h["split"] == "eval"]
      label = (lambda s: s) if k == 0 else (lambda s: None)
      it = [h["iteration"] for h in train]
      axes[0].plot(it, [h[RUBRIC] for h in train], color=colours[reward], alpha=0.7,
                   label=label(f"reward={reward}: hidden rubric"))
      if "visual_description/grm_reward" in train[0]:
        axes[0].plot(it, [h["visual_description/grm_reward"] for h in train], color=colours[reward], ls="--",
                     alpha=0.7, label=label(f"reward={reward}: judge's score"))
      axes[1].plot([h["iteration"] for h in evals], [h[RUBRIC] for h in evals], color=colours[reward], marker="o",
                   alpha=0.7, label=label(f"reward={reward}"))
  axes[0].set_title("training episodes: judge's score (dashed) and hidden rubric")
  axes[1].set_title("held-out descriptions: hidden rubric (sampled)")
  for ax in axes:
    ax.set_xlabel("RL iteration")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--judge", required=True, help="a workdir of configs/grm.py")
  parser.add_argument("--root", default="/tmp/grm_rl")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "grm_rl"))
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--rewards", default=",".join(REWARDS))
  parser.add_argument("--set", action="append", default=[], help="stage.section.field=value (stage: sft | rl)")
  args = parser.parse_args()
  logging.set_verbosity(logging.INFO)
  sft_dir = run_sft(args)
  seeds = [int(s) for s in args.seeds.split(",")]
  curves = {reward: {seed: run_rl(reward, seed, sft_dir, args) for seed in seeds}
            for reward in args.rewards.split(",")}
  table = summarize(curves)
  with open(os.path.join(sft_dir, "sft_eval.json")) as f:
    sft_eval = json.load(f)
  with open(args.out + ".json", "w") as f:
    json.dump({"judge": args.judge, "seeds": seeds, "sft_eval": sft_eval, "summary": table,
               "curves": {r: {str(s): h for s, h in by.items()} for r, by in curves.items()}}, f, indent=1)
  plot(curves, args.out + ".png")
  print("\nRL on descriptions (held-out hidden rubric, mean ± s.e. over seeds):")
  for reward, row in table.items():
    line = (f"  reward={reward:7s} sampled {row['start_rubric']['mean']:.3f} → {row['final_rubric']['mean']:.3f} "
            f"± {row['final_rubric']['se']:.3f}   greedy {row['start_greedy_rubric']['mean']:.3f} → "
            f"{row['final_greedy_rubric']['mean']:.3f} ± {row['final_greedy_rubric']['se']:.3f}")
    if "train_gap_last_quarter" in row:
      line += (f"   last quarter: judge {row['train_grm_reward_last_quarter']['mean']:.3f} vs rubric "
               f"{row['train_rubric_last_quarter']['mean']:.3f}; judge "
               f"{100 * row['judge_share_of_iteration']['mean']:.0f}% of an iteration")
    print(line)


if __name__ == "__main__":
  main()
