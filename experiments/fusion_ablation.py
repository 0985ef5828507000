"""Experiment: when to start mixing vision into pre-training (Kimi K2.5, Table 1), tiny, on CPU.

    python experiments/fusion_ablation.py [--steps 400 --seed 0 --model recipe --out OUT]
    python experiments/fusion_ablation.py --aggregate OUT_seed0.json OUT_seed1.json ... --out OUT

Three joint pre-training runs of `configs/pretrain.py:joint` with the recipe's tiny K2.5
(`--model recipe`, configs/recipe.py: the tiny chat decoder and its vision tower) or the
earlier small text backbone (`--model small`: 512 ids, 8 experts of 64), the same steps, batch
and total tokens, and the SAME total vision tokens (a tenth of all):

    early  10:90 from step 0          (vision_ratio 0.1, vision_start 0.0)
    mid    20:80 from 50% of the steps (vision_ratio 0.2, vision_start 0.5)
    late   50:50 from 80% of the steps (vision_ratio 0.5, vision_start 0.8)

Vision data: the quadrant-aligned synthetic tasks `count` (1–4 shapes) and `caption`
(colour, shape and quadrant of 1–2 shapes). After training, on held-out data:
  vision: count accuracy (the whole answer right under teacher forcing = greedy decoding),
          count and caption answer loss (nats per answer token), caption token accuracy;
  text:   held-out loss of the Python-stdlib documents (nats per byte).
The paper's ordering is early > mid > late on vision and text at equal vision tokens.
Writes `<out>.json` (settings, final metrics, eval curves, measured vision share, config)
and `<out>.txt` (the table). `--set section.field=value` overrides a config field in
every run (e.g. `--set train.batch=16`). `--aggregate` reads the JSONs of several seeds and
writes (`<out>.json`, `.txt`, `.png`) per setting the mean ± standard error (s / √n) of each
metric over the seeds, and per pair of settings and metric the mean of the per-seed
differences ± its standard error (the seeds are paired: each seed's three runs share their
data draws); a difference "exceeds the noise" when its mean lies more than two standard
errors from 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import jax
import numpy as np
from absl import logging

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import seed_stats  # noqa: E402
from configs import common, recipe as recipe_config  # noqa: E402
from k25jax.data import mixture, sources, tokenizer  # noqa: E402
from k25jax.model import k25  # noqa: E402
from k25jax.stages import pretrain  # noqa: E402
from k25jax.train import config_utils, joint, multimodal, objective, optimizer, sharding  # noqa: E402
from k25jax.train import trainer as trainer_lib  # noqa: E402

SETTINGS = {"early 10:90": (0.1, 0.0), "mid 20:80": (0.2, 0.5), "late 50:50": (0.5, 0.8)}
TASKS = ("count", "caption")
METRICS = (("count_accuracy", True), ("count_answer_loss", False), ("caption_answer_loss", False),
           ("caption_token_accuracy", True), ("text_loss", False))   # (final metric, higher is better)
TEXT = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def make_config(ratio: float, start: float, args):
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "pretrain.py"), "joint")
  config.model = (recipe_config.model_section(True, "tiny") if args.model == "recipe"
                  else common.k25_model_section("tiny", **TEXT))
  config.data.update(vision_ratio=ratio, vision_start=start, vision_tasks=TASKS, max_patches=1024)
  config.train.update(steps=args.steps, batch=8, seq_len=128, log_every=25, eval_every=args.steps // 4,
                      eval_batches=4, checkpoint_every=args.steps, keep_checkpoints=1, seed=args.seed)
  # AdamW, as when the committed results were measured (the joint preset's default is MuonClip now).
  config.optimizer.update(name="adamw", lr=2e-3, warmup_steps=min(20, args.steps // 4), decay_steps=args.steps // 4)
  config.mesh.update(data=1)
  config_utils.apply_overrides(config, args.set)
  return config


def measured_share(config, tok) -> float:
  """The vision share by tokens of the run's training batches (the same data the run reads)."""
  docs, _ = sources.split(sources.load(config.data.source, config.data.max_doc_chars), config.data.eval_every)
  it = mixture.mixture(docs=docs, tok=tok, schedule=joint.schedule(config), tasks=TASKS,
                       batch=config.train.batch, seq_len=config.train.seq_len, total_steps=config.train.steps,
                       seed=config.train.seed, max_patches=config.data.max_patches)
  return mixture.vision_share(it, config.train.steps)


def final_metrics(config, state, tok) -> dict[str, float]:
  """Held-out text loss; per-task answer loss and accuracy of held-out vision samples."""
  model_cfg = config_utils.k25_config_from(config.model, tok)
  model = k25.K25(model_cfg)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  _, text_eval, _ = joint.datasets(config, tok)
  kw = dict(docs=None, tok=tok, schedule=mixture.VisionSchedule(1.0), batch=config.train.batch,
            seq_len=config.train.seq_len, total_steps=1, seed=config.train.seed + 1,
            max_patches=config.data.max_patches)
  out = {}
  with jax.set_mesh(mesh):
    prepare = lambda b: multimodal.to_device(multimodal.device_features(b, model_cfg, config.data.max_patches), mesh)
    tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
    loss = objective.for_section(model, config.train)
    steps = {media: trainer_lib.eval_step(model, tx, loss, multimodal.batch_specs(media)) for media in (False, True)}
    text = multimodal.evaluate(steps[False], state, [prepare(b) for b in text_eval])
    out["text_loss"] = text["cross_entropy"]
    for task in TASKS:
      it = mixture.mixture(tasks=(task,), **kw)
      m = multimodal.evaluate(steps[True], state, [prepare(next(it)) for _ in range(6)])
      out[f"{task}_answer_loss"] = m["cross_entropy"]
      out[f"{task}_token_accuracy"] = m["accuracy"]
      out[f"{task}_accuracy"] = m.get("answer_exact", float("nan"))
  return out


def table(results: dict) -> str:
  cols = ("vision share", "count acc", "count ans. loss", "caption ans. loss", "caption tok. acc",
          "text loss")
  lines = [f"{'setting':12s} " + " ".join(f"{c:>17s}" for c in cols)]
  for name, r in results.items():
    m = r["final"]
    values = (r["measured_share"], m["count_accuracy"], m["count_answer_loss"], m["caption_answer_loss"],
              m["caption_token_accuracy"], m["text_loss"])
    lines.append(f"{name:12s} " + " ".join(f"{v:17.4f}" for v in values))
  return "\n".join(lines)


def ordering(results: dict) -> str:
  """Whether early ≥ mid ≥ late held on each metric (lower loss / higher accuracy is better)."""
  names = list(SETTINGS)
  verdicts = []
  for metric, better_high in METRICS:
    values = [results[n]["final"][metric] for n in names]
    if max(values) - min(values) < 1e-6:
      verdicts.append(f"{metric}: a tie ({values[0]:.4f})")
      continue
    score = values if better_high else [-v for v in values]
    order = [names[i] for i in np.argsort(score, kind="stable")[::-1]]
    verdicts.append(f"{metric}: {' > '.join(order)}" + (" (the paper's order)" if order == names else ""))
  return "\n".join(verdicts)


def aggregate(runs: list[dict]) -> dict:
  """Per setting and metric, mean ± s.e. over the seeds' runs; per pair of settings and metric,
  the paired difference (first − second) mean ± s.e. and whether it exceeds the noise (|mean| > 2 s.e.)."""
  names = list(SETTINGS)
  final = {n: {m: [r["results"][n]["final"][m] for r in runs] for m, _ in METRICS} for n in names}
  settings = {n: {m: seed_stats.mean_and_error(v) for m, v in final[n].items()} for n in names}
  pairs = {}
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      for m, higher in METRICS:
        pairs[f"{a} vs {b}: {m}"] = seed_stats.paired_difference(final[a][m], final[b][m], higher, (a, b))
  return dict(seeds=[r["args"]["seed"] for r in runs], per_seed=final, settings=settings, pairs=pairs)


def aggregate_table(result: dict) -> str:
  cols = [m for m, _ in METRICS]
  lines = [f"{len(result['seeds'])} seeds {result['seeds']}: mean ± standard error", "",
           f"{'setting':12s} " + " ".join(f"{c:>24s}" for c in cols)]
  for name, metrics in result["settings"].items():
    lines.append(f"{name:12s} " + " ".join(f"{metrics[c][0]:>12.4f} ± {metrics[c][1]:<9.4f}" for c in cols))
  lines += ["", "paired differences (first − second), mean ± s.e.; * where |mean| > 2 s.e.:"]
  for key, d in result["pairs"].items():
    mark = "*" if d["exceeds_noise"] else " "
    lines.append(f"{mark} {key:48s} {d['mean']:+.4f} ± {d['error']:.4f}  (better: {d['better']})")
  return "\n".join(lines)


def plot_aggregate(result: dict, path: str) -> None:
  """A panel a metric: each setting's mean over seeds with ± 1 standard error, and each seed's value."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = list(result["settings"])
  fig, axes = plt.subplots(1, len(METRICS), figsize=(3.2 * len(METRICS), 3.4))
  for ax, (metric, higher) in zip(axes, METRICS):
    means, errors = zip(*(result["settings"][n][metric] for n in names))
    ax.bar(range(len(names)), means, yerr=errors, capsize=4, color="#9ab", edgecolor="#456")
    for i, n in enumerate(names):
      ax.plot([i] * len(result["per_seed"][n][metric]), result["per_seed"][n][metric], "k.", alpha=0.5)
    low = min(min(result["per_seed"][n][metric]) for n in names)
    high = max(max(result["per_seed"][n][metric]) for n in names)
    ax.set_ylim(low - 0.15 * (high - low + 1e-9), high + 0.15 * (high - low + 1e-9))
    ax.set_xticks(range(len(names)), [n.split()[0] for n in names])
    ax.set_title(metric.replace("_", " ") + (" ↑" if higher else " ↓"), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
  fig.suptitle(f"Table 1 at tiny size: mean ± s.e. over seeds {result['seeds']} (dots: each seed)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "fusion_ablation"))
  parser.add_argument("--workdir", default="/tmp/fusion_ablation")
  parser.add_argument("--set", action="append", default=[], help="section.field=value, for every run")
  parser.add_argument("--model", choices=("recipe", "small"), default="recipe")
  parser.add_argument("--aggregate", nargs="+", metavar="JSON", help="seeds' result files to summarise")
  args = parser.parse_args()
  if args.aggregate:
    runs = []
    for path in args.aggregate:
      with open(path) as f:
        runs.append(json.load(f))
    result = aggregate(runs)
    text = aggregate_table(result)
    print(text)
    with open(args.out + ".json", "w") as f:
      json.dump(dict(result, inputs=args.aggregate), f, indent=1)
    with open(args.out + ".txt", "w") as f:
      f.write("python experiments/fusion_ablation.py --aggregate " + " ".join(args.aggregate) + "\n\n" + text + "\n")
    plot_aggregate(result, args.out + ".png")
    return
  logging.set_verbosity(logging.WARNING)
  tok = tokenizer.ByteTokenizer(media=True)
  results = {}
  for name, (ratio, start) in SETTINGS.items():
    config = make_config(ratio, start, args)
    workdir = os.path.join(args.workdir, name.split()[0])
    shutil.rmtree(workdir, ignore_errors=True)                # a fresh run, never a resume
    t0 = time.perf_counter()
    state, history = pretrain.run(config, workdir)
    results[name] = dict(ratio=ratio, start=start, overall_share=joint.schedule(config).overall_share,
                         measured_share=measured_share(config, tok), final=final_metrics(config, state, tok),
                         curves=[h for h in history if h["split"] == "eval"], seconds=time.perf_counter() - t0)
    print(f"{name}: {results[name]['final']}  ({results[name]['seconds']:.0f} s)", flush=True)
  text = table(results) + "\n\n" + ordering(results)
  print("\n" + text)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump(dict(results=results, args=vars(args), config=make_config(0.1, 0.0, args).to_dict()), f, indent=1,
              default=str)
  with open(args.out + ".txt", "w") as f:
    f.write(f"python experiments/fusion_ablation.py --steps {args.steps} --seed {args.seed} --model {args.model} "
            + " ".join(f"--set {s}" for s in args.set) + "\n\n" + text + "\n")


if __name__ == "__main__":
  main()
