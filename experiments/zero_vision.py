"""Experiment: zero-vision SFT as the start of vision RL (Kimi K2.5, Fig. 2's claim), tiny, on CPU.

    python experiments/zero_vision.py [--root /tmp/zero_vision] [--out experiments/results/zero_vision]
                                      [--tools tool,no_tool] [--starts zero_vision,...]
                                      [--set stage.section.field=value ...]

One chain of stages, each in its own workdir under --root (a finished one is reused):

    base         configs/pretrain.py:joint with the model of configs/sft.py: the vision stages
                 (joint vision–text pre-training from step 0 on text and synthetic images)
    zero_vision  configs/sft.py from base: text-only tool trajectories, no image ever seen
    text_vision  configs/sft.py:tiny,visual from base: the same + image → direct-answer examples
    no_sft       base itself
    zero_vision_no_base  configs/sft.py from a fresh init: zero-vision SFT without the vision
                 stages (a random tower: does the transfer need joint pre-training?)
    rl/<start>/<tool>   configs/rl.py:vision[,no_tool] (the rl_vision stage) from each start: the
                 image in the prompt, with the sandboxed Python tool (tool) or without it (no_tool)

Reports the vision-RL curves (held-out sampled accuracy along RL) per start and tool
setting, which start wins at the end of RL and by how much, and the SFT evaluations.
Writes `<out>.json` and `<out>.png`. `--set` overrides a config field of one stage:
`--set base.train.steps=100`, `--set sft.train.steps=600`, `--set rl.train.steps=20` (RL iterations).
Each stage starts from the previous one through its `init.checkpoint`.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import matplotlib
from absl import logging

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from k25jax.stages import pretrain, rl_vision, sft  # noqa: E402
from k25jax.train import config_utils  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
STARTS = ("zero_vision", "text_vision", "no_sft", "zero_vision_no_base")
SFT_STARTS = ("zero_vision", "text_vision", "zero_vision_no_base")
STAGES = ("base", "sft", "rl")


def load(path: str, arg: str, stage: str, args, defaults: tuple[str, ...] = ()):
  """The stage's config with `defaults` (field=value) applied, then the --set overrides of `stage`."""
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", path), arg)
  overrides = [s.split(".", 1)[1] for s in args.set if s.split(".", 1)[0] == stage]
  config_utils.apply_overrides(config, [*defaults, *overrides])
  return config


def base_config(args):
  # AdamW, as when the committed results were measured (the joint preset's default is MuonClip now).
  config = load("pretrain.py", "joint", "base", args, defaults=("optimizer.name=adamw",))
  config.model = load("sft.py", "tiny", "sft", args).model      # the chat model of the SFT and RL stages
  return config


def sft_config(start: str, base_dir: str, args):
  config = load("sft.py", "tiny,visual" if start == "text_vision" else "tiny", "sft", args)
  config.init.checkpoint = "" if start == "zero_vision_no_base" else base_dir
  return config


def rl_config(start_dir: str, tool: str, args):
  config = load("rl.py", "vision" if tool == "tool" else "vision,no_tool", "rl", args)
  config.init.checkpoint = start_dir
  return config


def run_base(args) -> str:
  workdir = os.path.join(args.root, "base")
  config = base_config(args)
  done = os.path.join(workdir, "checkpoints", str(config.train.steps))
  if not os.path.isdir(done):
    t0 = time.perf_counter()
    pretrain.run(config, workdir)
    logging.info("zero_vision: base (joint pre-training) took %.1f min", (time.perf_counter() - t0) / 60)
  return workdir


def sft_results(config, workdir: str) -> dict:
  """The held-out evaluation of `sft.run(config, workdir)` (workdir/sft_eval.json), run only
  when that file is not there yet."""
  path = os.path.join(workdir, "sft_eval.json")
  if not os.path.exists(path):
    t0 = time.perf_counter()
    sft.run(config, workdir)
    logging.info("SFT in %s took %.1f min", workdir, (time.perf_counter() - t0) / 60)
  with open(path) as f:
    return json.load(f)


def run_sft(start: str, base_dir: str, args) -> dict:
  return sft_results(sft_config(start, base_dir, args), os.path.join(args.root, start))


def rl_curves(config, workdir: str) -> dict:
  """{"history": the logged rows of `rl_vision.run(config, workdir)`, "minutes": its time}, from
  workdir/curves.json once the run has finished (then it is not run again)."""
  path = os.path.join(workdir, "curves.json")
  if not os.path.exists(path):
    t0 = time.perf_counter()
    _, history = rl_vision.run(config, workdir)
    curves = [{k: v for k, v in h.items() if isinstance(v, (int, float, str))} for h in history]
    with open(path, "w") as f:
      json.dump({"history": curves, "minutes": (time.perf_counter() - t0) / 60}, f, indent=1)
  with open(path) as f:
    return json.load(f)


def run_rl(start: str, start_dir: str, tool: str, args) -> list[dict]:
  return rl_curves(rl_config(start_dir, tool, args), os.path.join(args.root, "rl", start, tool))["history"]


def summarize(curves: dict) -> dict:
  """Per (tool, start): held-out accuracy at the start and the end of RL; per tool, the winner
  at the end and its margin over the runner-up (sampled accuracy)."""
  table = {}
  for tool, by_start in curves.items():
    rows = {}
    for start, history in by_start.items():
      evals = [h for h in history if h["split"] == "eval"]
      rows[start] = {"start_accuracy": evals[0]["accuracy"], "final_accuracy": evals[-1]["accuracy"],
                     "start_greedy": evals[0]["greedy_accuracy"], "final_greedy": evals[-1]["greedy_accuracy"],
                     "final_tool_call_success": evals[-1]["tool_call_success"],
                     "final_calls_per_episode": evals[-1]["calls_per_episode"]}
    ranked = sorted(rows, key=lambda s: rows[s]["final_accuracy"], reverse=True)
    margin = rows[ranked[0]]["final_accuracy"] - rows[ranked[1]]["final_accuracy"] if len(ranked) > 1 else None
    table[tool] = {"rows": rows, "winner": ranked[0], "margin": margin}
  return table


def plot(curves: dict, path: str) -> None:
  fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
  for ax, (tool, by_start) in zip(axes[0], curves.items()):
    for start, history in by_start.items():
      evals = [h for h in history if h["split"] == "eval"]
      ax.plot([h["iteration"] for h in evals], [h["accuracy"] for h in evals], marker="o", label=start)
    ax.set_title(f"vision RL, image in the prompt, {'with' if tool == 'tool' else 'without'} the Python tool")
    ax.set_xlabel("RL iteration")
    ax.set_ylabel("held-out accuracy (sampled)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def print_table(table: dict, sft_evals: dict) -> None:
  print("\nSFT (greedy, held-out):   start                setting        accuracy  tool-call success")
  for start, results in sft_evals.items():
    for setting, r in results.items():
      print(f"{'':26s} {start:20s} {setting:14s} {r['accuracy']:8.3f}  {r['tool_call_success']:8.3f}")
  for tool, t in table.items():
    print(f"\nvision RL ({tool}): held-out sampled accuracy, start → end of RL (greedy in brackets)")
    for start, r in t["rows"].items():
      print(f"  {start:20s} {r['start_accuracy']:.3f} → {r['final_accuracy']:.3f}   "
            f"({r['start_greedy']:.3f} → {r['final_greedy']:.3f})   calls/episode {r['final_calls_per_episode']:.2f}")
    if t["margin"] is not None:
      print(f"  winner: {t['winner']} by {t['margin']:+.3f} accuracy over the runner-up")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--root", default="/tmp/zero_vision", help="workdirs of the chain's stages")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "zero_vision"))
  parser.add_argument("--tools", default="tool,no_tool", help="RL settings: tool, no_tool or both")
  parser.add_argument("--starts", default=",".join(STARTS), help=f"RL starts, some of {STARTS}")
  parser.add_argument("--set", action="append", default=[], help="stage.section.field=value, stage in "
                      f"{STAGES}")
  args = parser.parse_args()
  for item in args.set:
    if item.split(".", 1)[0] not in STAGES:
      raise ValueError(f"--set {item!r}: start with one of {STAGES} (e.g. rl.train.steps=20)")
  starts = [s for s in args.starts.split(",") if s]
  unknown = set(starts) - set(STARTS)
  if unknown or not starts:
    raise ValueError(f"--starts {args.starts!r}: choose from {STARTS}")
  logging.set_verbosity(logging.INFO)
  base_dir = run_base(args) if set(starts) != {"zero_vision_no_base"} else None
  start_dirs = {s: os.path.join(args.root, s) for s in SFT_STARTS}
  start_dirs["no_sft"] = base_dir
  sft_evals = {start: run_sft(start, base_dir, args) for start in starts if start in SFT_STARTS}
  curves = {tool: {start: run_rl(start, start_dirs[start], tool, args) for start in starts}
            for tool in args.tools.split(",")}
  table = summarize(curves)
  print_table(table, sft_evals)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump({"summary": table, "sft": sft_evals, "curves": curves, "set": args.set, "tools": args.tools,
               "starts": starts}, f,
              indent=1)
  plot(curves, args.out + ".png")
  print(f"\nwrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
  main()
