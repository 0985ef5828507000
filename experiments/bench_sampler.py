"""Benchmark: decode tokens/s of our latent-cache sampler against transformers' generate, same weights.

    python experiments/bench_sampler.py [--batch 8 --prompt 64 --new 128 --steps 3]

Greedy decoding of `--new` tokens after a `--prompt`-token prompt, timed as the median
of several runs after a warm-up (compilation excluded), both implementations
interleaved in one run. Also prints the cache cost per token: ours keeps the latent
and the rope key per layer, a per-head K/V cache keeps heads × (qk_head_dim + v_head_dim).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from k25jax.convert import hf
from k25jax.model import config as model_config
from k25jax.rl import sampler

from bench_forward import REFERENCE


def cache_numbers_per_token(cfg) -> dict[str, int]:
  latent = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
  per_head = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
  return {"latent_cache": latent, "per_head_kv_cache": per_head}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=64)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--out", default="experiments/results/bench_sampler.json")
  args = parser.parse_args()

  torch.manual_seed(0)
  hf_model = DeepseekV3ForCausalLM(DeepseekV3Config(**REFERENCE)).eval()
  prompts = np.random.default_rng(0).integers(0, REFERENCE["vocab_size"], size=(args.batch, args.prompt))
  with tempfile.TemporaryDirectory() as path:
    hf_model.save_pretrained(path)
    cfg, params = hf.load(path)
  sampling = sampler.SamplingConfig(max_new_tokens=args.new, temperature=0)
  lengths = np.full((args.batch,), args.prompt)
  ids = torch.as_tensor(prompts)

  def ours():
    out = sampler.generate(cfg, params, prompts, lengths, jax.random.PRNGKey(0), sampling)
    return np.asarray(jax.block_until_ready(out["tokens"]))

  def theirs():
    with torch.no_grad():
      return hf_model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[:, args.prompt:].numpy()

  closures = {"k25jax latent cache": ours, "transformers generate": theirs}
  outputs = {name: fn() for name, fn in closures.items()}  # warm-up and compile
  times = {name: [] for name in closures}
  for _ in range(args.steps):
    for name, fn in closures.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  agree = float(np.mean(outputs["k25jax latent cache"] == outputs["transformers generate"]))

  n_tokens = args.batch * args.new
  rows = {name: {"seconds": statistics.median(t), "tokens_per_s": n_tokens / statistics.median(t)}
          for name, t in times.items()}
  base = rows["transformers generate"]["tokens_per_s"]
  print(f"greedy decode, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, CPU "
        f"({os.cpu_count()} cores, torch threads {torch.get_num_threads()}), median of {args.steps}")
  print(f"{'implementation':24s} {'tokens/s':>10s} {'vs transformers':>16s}")
  for name, row in rows.items():
    row["ratio"] = row["tokens_per_s"] / base
    print(f"{name:24s} {row['tokens_per_s']:10.0f} {row['ratio']:15.2f}x")
  print(f"greedy tokens equal to transformers': {agree:.1%}")
  cache = {name: cache_numbers_per_token(c) for name, c in
           (("tiny", cfg), ("k25", model_config.preset("k25")))}
  print(f"\n{'cache numbers / token':24s} {'latent':>10s} {'per-head K/V':>14s} {'ratio':>8s}")
  for name, c in cache.items():
    print(f"{name:24s} {c['latent_cache']:10d} {c['per_head_kv_cache']:14d} "
          f"{c['per_head_kv_cache'] / c['latent_cache']:7.1f}x")
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"args": vars(args), "runs": rows, "token_agreement": agree, "cache_per_token": cache}, f, indent=2)
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
