"""Benchmark: the tiny K2 decoder, ours (dense | ragged experts) against transformers, same weights.

    python experiments/bench_forward.py [--batch 8 --seq 512 --steps 5 --out experiments/results/bench_forward.json]

Measures tokens/s of forward, forward+backward, and a train step (forward+backward+AdamW)
for each implementation in one run, so the ratio is what to read (this machine is shared
and noisy). Also reports XLA's compiled flop count of one MoE layer against the analytic
count of the work that routing asks for, for 16 and 384 experts: the dropless path must
not pay for experts a token was not routed to.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from k25jax.convert import hf
from k25jax.model import config as model_config
from k25jax.model import moe, transformer

REFERENCE = dict(  # BENCHMARKS.md, "the reference tiny configuration"
    vocab_size=4096, hidden_size=256, num_hidden_layers=4, first_k_dense_replace=1,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
    num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=128, intermediate_size=512,
    n_group=1, topk_group=1, num_nextn_predict_layers=0, max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0))


def round_robin(closures: dict, steps: int) -> dict:
  """Median seconds of each closure, timed in interleaved rounds so machine noise hits all alike."""
  for fn in closures.values():
    fn()  # compile / warm up
  times = {name: [] for name in closures}
  for _ in range(steps):
    for name, fn in closures.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def transformers_steps(model, tokens: np.ndarray) -> dict:
  ids = torch.as_tensor(tokens, dtype=torch.long)
  opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

  def forward():
    with torch.no_grad():
      model(ids, labels=ids)

  def forward_backward():
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()

  def train():
    forward_backward()
    opt.step()

  model.train()
  return {"forward": forward, "forward_backward": forward_backward, "train": train}


def lm_loss(logits, tokens):
  logits, targets = logits[:, :-1], tokens[:, 1:]
  return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])


def our_steps(cfg, params, tokens: np.ndarray) -> dict:
  model = transformer.Transformer(cfg)
  tokens = jnp.asarray(tokens, jnp.int32)
  tx = optax.adamw(1e-4)

  def loss_fn(p):
    return lm_loss(model.apply({"params": p}, tokens)[0], tokens)

  forward = jax.jit(loss_fn)
  forward_backward = jax.jit(jax.value_and_grad(loss_fn))

  @jax.jit
  def train(p, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, opt_state = tx.update(grads, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, loss

  state = [params, tx.init(params)]

  def train_step():
    state[0], state[1], loss = train(*state)
    jax.block_until_ready(loss)

  return {"forward": lambda: jax.block_until_ready(forward(params)),
          "forward_backward": lambda: jax.block_until_ready(forward_backward(params)),
          "train": train_step}


def moe_layer_flops(n_experts: int, top_k: int, tokens: int, impl: str) -> dict[str, float]:
  """Compiled flops of one routed-expert layer (router + experts) vs the analytic active count."""
  cfg = model_config.preset("tiny", n_routed_experts=n_experts, num_experts_per_tok=top_k, moe_impl=impl,
                            n_shared_experts=0)
  layer = moe.MoE(cfg)
  x = jax.ShapeDtypeStruct((1, tokens, cfg.hidden_size), jnp.float32)
  variables = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)
  compiled = jax.jit(lambda v, x: layer.apply(v, x)[0]).lower(variables, x).compile()
  flops = float(compiled.cost_analysis()["flops"])
  d, f = cfg.hidden_size, cfg.moe_intermediate_size
  analytic = tokens * (top_k * 3 * 2 * d * f + 2 * d * n_experts)
  return {"experts": n_experts, "top_k": top_k, "tokens": tokens, "impl": impl,
          "compiled_flops": flops, "analytic_flops": analytic, "ratio": flops / analytic}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--out", default="experiments/results/bench_forward.json")
  args = parser.parse_args()

  torch.manual_seed(0)
  hf_model = DeepseekV3ForCausalLM(DeepseekV3Config(**REFERENCE))
  tokens = np.random.default_rng(0).integers(0, REFERENCE["vocab_size"], size=(args.batch, args.seq))
  n_tokens = args.batch * args.seq
  results = {"batch": args.batch, "seq": args.seq, "steps": args.steps, "torch_threads": torch.get_num_threads(),
             "cpu_count": os.cpu_count(), "jax_backend": jax.default_backend(),
             "runs": {}}
  closures = {}
  with tempfile.TemporaryDirectory() as path:
    hf_model.save_pretrained(path)
    for impl in ("ragged", "dense"):
      cfg, params = hf.load(path, moe_impl=impl)
      closures[f"k25jax {impl}"] = our_steps(cfg, params, tokens)
  closures["transformers"] = transformers_steps(hf_model, tokens)
  flat = {(name, mode): fn for name, modes in closures.items() for mode, fn in modes.items()}
  timed = round_robin(flat, args.steps)
  for (name, mode), seconds in timed.items():
    results["runs"].setdefault(name, {})[mode] = seconds

  results["transformers_experts_implementation"] = hf_model.config._experts_implementation
  results["transformers_attention_implementation"] = hf_model.config._attn_implementation
  base = results["runs"]["transformers"]
  print(f"tiny K2 decoder, batch {args.batch} x seq {args.seq}, CPU ({os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}), median of {args.steps} steps")
  print(f"{'implementation':22s} {'fwd tok/s':>10s} {'fwd+bwd tok/s':>14s} {'train tok/s':>12s} {'train vs HF':>12s}")
  for name, times in results["runs"].items():
    rate = {k: n_tokens / v for k, v in times.items()}
    times_ratio = base["train"] / times["train"]
    results["runs"][name] = {**times, **{f"{k}_tokens_per_s": r for k, r in rate.items()},
                             "train_speedup_vs_transformers": times_ratio}
    print(f"{name:22s} {rate['forward']:10.0f} {rate['forward_backward']:14.0f} {rate['train']:12.0f} "
          f"{times_ratio:11.2f}x")

  results["moe_flops"] = [moe_layer_flops(16, 4, n_tokens, impl) for impl in ("ragged", "dense")]
  results["moe_flops"] += [moe_layer_flops(384, 8, n_tokens, impl) for impl in ("ragged", "dense")]
  print(f"\n{'MoE layer flops':22s} {'experts':>8s} {'top-k':>6s} {'compiled GF':>12s} {'analytic GF':>12s} {'ratio':>7s}")
  for row in results["moe_flops"]:
    print(f"{row['impl']:22s} {row['experts']:8d} {row['top_k']:6d} {row['compiled_flops'] / 1e9:12.2f} "
          f"{row['analytic_flops'] / 1e9:12.2f} {row['ratio']:7.2f}")
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=2)
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
