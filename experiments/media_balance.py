"""How evenly the vision work spreads when media are sharded with their rows.

    python experiments/media_balance.py [--shards 8 64 512 --batches 3 --rows_per_shard 2 \
        --seq_len 4096 --ratio 0.1 --shard_budget 1024 --out experiments/results/media_balance]

The synthetic joint mixture (`k25jax.data.mixture`, the five visual tasks, text from the
Python standard library) at the shape of `configs/pretrain.py:k25,joint`: D data shards of
`rows_per_shard` rows of `seq_len` tokens, a vision share `ratio` by tokens. Each shard
encodes its own rows' media; its vision tower work is its patch count p_d. Per batch:

    imbalance       = max_d p_d / mean_d p_d   (1: even; the busiest shard sets the budget)
    vs replicated   = Σ_d p_d / max_d p_d      (every device encoding every image, as before,
                                                against the busiest shard)

for two placements of the same stream: `balanced` (the mixture's own: each sample to the
least-loaded shard with room) and `first-fit` (the placement without shards, first row with
room, its rows then cut into the same D shards). Writes `<out>.json` and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from k25jax.data import mixture, sources, tokenizer, visual_synthetic  # noqa: E402
from k25jax.model import media as media_lib, vision  # noqa: E402
from k25jax.train import multimodal  # noqa: E402


def shard_patches(batch: dict, shards: int, media_ids) -> np.ndarray:
  """Patches of each of `shards` consecutive row groups, from their rows' placeholders."""
  per_shard = media_lib.placeholder_mask(batch["inputs"], media_ids).reshape(shards, -1).sum(1)
  tokens = [vision.num_media_tokens(m.grid_thw) for m in batch["media"]]
  groups = multimodal.split_items(batch["media"], tokens, per_shard)
  return np.asarray([sum(m.pixel_values.shape[0] for m in group) for group in groups])


def measure(shards: int, args, docs, tok) -> dict:
  media_ids = (tok.media.pad,)
  rows = shards * args.rows_per_shard
  out = {}
  for placement, placement_shards in (("balanced", shards), ("first-fit", 1)):
    it = mixture.mixture(docs=docs, tok=tok, schedule=mixture.VisionSchedule(args.ratio),
                         tasks=visual_synthetic.TASKS, batch=rows, seq_len=args.seq_len, total_steps=args.batches,
                         seed=0, max_patches=args.shard_budget * shards, shards=placement_shards)
    per_batch = []
    for _ in range(args.batches):
      batch = next(it)
      patches = shard_patches(batch, shards, media_ids)
      per_batch.append({"patches_mean": float(patches.mean()), "patches_max": int(patches.max()),
                        "patches_min": int(patches.min()), "imbalance": mixture.patch_imbalance(patches),
                        "vs_replicated": float(patches.sum() / max(patches.max(), 1)),
                        "vision_share": float(batch["is_vision"].mean())})
    out[placement] = {"batches": per_batch, **{f"{k}_mean": float(np.mean([b[k] for b in per_batch]))
                                               for k in per_batch[0]},
                      "imbalance_worst": float(max(b["imbalance"] for b in per_batch))}
  return out


def table(results: dict) -> str:
  lines = ["| shards | placement | patches a shard (mean) | busiest shard | imbalance mean / worst | "
           "vs replicated | vision share |", "|---|---|---|---|---|---|---|"]
  for shards, by_placement in results.items():
    for placement, r in by_placement.items():
      lines.append(f"| {shards} | {placement} | {r['patches_mean_mean']:.0f} | {r['patches_max_mean']:.0f} | "
                   f"{r['imbalance_mean']:.3f} / {r['imbalance_worst']:.3f} | {r['vs_replicated_mean']:.1f}x | "
                   f"{r['vision_share_mean']:.3f} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shards", type=int, nargs="+", default=[8, 64, 512])
  parser.add_argument("--batches", type=int, default=3)
  parser.add_argument("--rows_per_shard", type=int, default=2)
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--ratio", type=float, default=0.1)
  parser.add_argument("--shard_budget", type=int, default=1024, help="patches a shard may hold")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "media_balance"))
  args = parser.parse_args()
  tok = tokenizer.ByteTokenizer(media=True)
  docs, _ = sources.split(sources.load("python_stdlib", 8000), 50)
  results = {}
  for shards in args.shards:
    results[shards] = measure(shards, args, docs, tok)
    print(table({shards: results[shards]}).splitlines()[-2:], flush=True)
  print(table(results))
  with open(args.out + ".json", "w") as f:
    json.dump({"args": vars(args), "results": results}, f, indent=2)
  with open(args.out + ".md", "w") as f:
    f.write(f"python experiments/media_balance.py (rows of {args.seq_len}, {args.rows_per_shard} a shard, vision "
            f"share {args.ratio}, {args.batches} batches, budget {args.shard_budget} patches a shard)\n\n"
            + table(results) + "\n")
  print(f"wrote {args.out}.json, {args.out}.md")


if __name__ == "__main__":
  main()
