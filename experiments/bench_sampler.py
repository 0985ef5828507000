"""Benchmark: decode tokens/s of our latent-cache sampler against transformers' generate, same weights.

    python experiments/bench_sampler.py [--batch 8 --prompt 64 --new 128 --steps 5 --processes 3]

Greedy decoding of `--new` tokens after a `--prompt`-token prompt, same weights (the
reference tiny configuration). First both decode once and must produce the same tokens
(at least 99%); then they are timed interleaved, compilation excluded, in each of
`--processes` processes with the load beside them recorded (`interleave.py`); the JSON is
written only when no process ran beside other work. Also prints the cache cost per
token: ours keeps the latent and the rope key per layer, a per-head K/V cache keeps
heads × (qk_head_dim + v_head_dim).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import interleave  # noqa: E402
from bench_forward import REFERENCE  # noqa: E402
from k25jax.convert import hf  # noqa: E402
from k25jax.model import config as model_config  # noqa: E402
from k25jax.rl import sampler  # noqa: E402

MIN_AGREEMENT = 0.99   # share of greedy tokens both must produce alike (float32; a near-tie may flip)


def cache_numbers_per_token(cfg) -> dict[str, int]:
  latent = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
  per_head = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
  return {"latent_cache": latent, "per_head_kv_cache": per_head}


PEER = "transformers generate"


def one_process(args) -> dict:
  """Both decoders on the same weights and prompts: greedy tokens compared, then timed interleaved."""
  torch.set_num_threads(os.cpu_count())
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

  closures = {"k25jax latent cache": ours, PEER: theirs}
  agree = float(np.mean(ours() == theirs()))
  if agree < MIN_AGREEMENT:     # greedy decoding of the same weights: the same tokens, or no benchmark
    raise SystemExit(f"greedy tokens agree on {agree:.1%} only: not the same computation")
  times, others = interleave.round_robin(closures, args.steps, args.warmup)
  return {"token_agreement": agree, "other_cores": others, "times": times}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=64)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=1)
  interleave.add_process_arguments(parser)
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "bench_sampler.json"))
  args = parser.parse_args()
  runs = interleave.runs_or_child(__file__, args, one_process,
                                  [f"--batch={args.batch}", f"--prompt={args.prompt}", f"--new={args.new}",
                                   f"--steps={args.steps}", f"--warmup={args.warmup}"])
  if runs is None:
    return
  summary = interleave.summarize(runs, [PEER], args.batch * args.new, args.max_load)
  print(f"greedy decode, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, CPU ({os.cpu_count()} "
        f"cores), {args.processes} process(es) x {args.steps} interleaved runs; other processes used "
        + ", ".join(f"{c:.2f}" for c in summary["other_cores"]) + " cores")
  print(f"{'implementation':24s} {'tokens/s':>10s} {'vs transformers':>16s}  per process")
  for name, row in summary["contenders"].items():
    print(f"{name:24s} {row['per_s']:10.0f} {row['speed_vs_peer']:15.2f}x  "
          + " ".join(f"{r:.2f}" for r in row["speed_vs_peer_per_process"]))
  print("greedy tokens equal to transformers': " + ", ".join(f"{r['token_agreement']:.1%}" for r in runs))
  cfg = model_config.ModelConfig.from_hf_dict(DeepseekV3Config(**REFERENCE).to_dict())
  cache = {name: cache_numbers_per_token(c) for name, c in (("tiny", cfg), ("k25", model_config.preset("k25")))}
  print(f"\n{'cache numbers / token':24s} {'latent':>10s} {'per-head K/V':>14s} {'ratio':>8s}")
  for name, c in cache.items():
    print(f"{name:24s} {c['latent_cache']:10d} {c['per_head_kv_cache']:14d} "
          f"{c['per_head_kv_cache'] / c['latent_cache']:7.1f}x")
  result = {"args": {k: v for k, v in vars(args).items() if k != "one"}, "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "torch": torch.__version__, "runs": runs, **summary, "cache_per_token": cache}
  interleave.write_unless_loaded(args.out, result, args.allow_load)


if __name__ == "__main__":
  main()
