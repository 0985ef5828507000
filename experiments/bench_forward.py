"""Benchmark: the train step of the tiny K2 decoder, k25jax against transformers, same weights and batch.

    python experiments/bench_forward.py [--processes 3 --steps 7 --warmup 2 --out experiments/results/bench_forward.json]

Contenders, each one full train step (forward, backward, AdamW) on batch 8 × 512 tokens of
the reference configuration (BENCHMARKS.md), all from the same weights:

    transformers          DeepseekV3ForCausalLM, its default (grouped_mm) experts
    transformers eager    the same model with the eager expert loop
    k25jax stage          the pretrain stage's own step (`pretrain.make_step`: next-token loss with
                          the z and balance terms, router-bias update, clipping, non-finite guards)
    k25jax model          the bare model: cross-entropy (from the hidden states and the head,
                          as the stage's objective), value_and_grad, AdamW

Before anything is timed, every contender's first cross-entropy must equal transformers'
(relative 1e-5): they compute the same thing. Then they are timed interleaved in each of
`--processes` processes, with the load beside them recorded (`interleave.py`); the JSON
is written only when no process ran beside other work (or, marked, with `--allow_load`).

`--parts` also times forward + backward of each part alone, interleaved the same way
(the LM head with the cross-entropy, one MLA attention layer, one MoE layer, the dense
MLP, the AdamW update), and the stage's own overhead (its step minus the model step).
The minor page faults of one step of each contender are recorded too (pages a step gets
fresh from the kernel; `interleave.minor_page_faults`). It also reports XLA's compiled
flop count of one MoE layer against the analytic count of the work routing asks for, at
16 and 384 experts.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import interleave  # noqa: E402

from k25jax import losses  # noqa: E402
from k25jax.convert import hf  # noqa: E402
from k25jax.model import attention, layers, moe, transformer  # noqa: E402
from k25jax.model import config as model_config  # noqa: E402
from k25jax.stages import pretrain  # noqa: E402
from k25jax.train import config_utils, optimizer, sharding, trainer as trainer_lib  # noqa: E402

REFERENCE = dict(  # BENCHMARKS.md, "the reference tiny configuration"
    vocab_size=4096, hidden_size=256, num_hidden_layers=4, first_k_dense_replace=1,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
    num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=128, intermediate_size=512,
    n_group=1, topk_group=1, num_nextn_predict_layers=0, max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0))
PEER = "transformers"


# ----------------------------------------------------------------------------- contenders
def hf_models(experts: str):
  torch.manual_seed(0)
  model = DeepseekV3ForCausalLM(DeepseekV3Config(**REFERENCE))
  model.config._experts_implementation = experts
  return model.train()


def hf_step(model, tokens: np.ndarray):
  ids = torch.as_tensor(tokens, dtype=torch.long)
  opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

  def step():
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    return loss.item()
  return step


def shifted_batch(tokens: np.ndarray) -> dict[str, np.ndarray]:
  """The stage's batch of `tokens`: every position an input, targets shifted, the last unscored
  (the positions transformers' `labels=ids` scores)."""
  b, s = tokens.shape
  return {"inputs": tokens.astype(np.int32),
          "targets": np.concatenate([tokens[:, 1:], tokens[:, :1]], 1).astype(np.int32),
          "loss_mask": np.concatenate([np.ones((b, s - 1)), np.zeros((b, 1))], 1).astype(np.float32),
          "positions": np.tile(np.arange(s, dtype=np.int32), (b, 1)), "segment_ids": np.ones((b, s), np.int32)}


def stage_step(cfg, params, tokens: np.ndarray):
  """The pretrain stage's jitted step (configs/pretrain.py's train and optimizer sections)."""
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "pretrain.py"))
  model = transformer.Transformer(cfg)
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  mesh = sharding.make_mesh(dict(data=1), devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    state = [trainer_lib.new_state(model, tx, mesh, 0, params)]
    train = pretrain.make_step(config, model, tx)
  batch = jax.device_put(shifted_batch(tokens))

  def step():
    with jax.set_mesh(mesh):
      state[0], metrics = train(state[0], batch)
    return float(metrics["cross_entropy"])
  return step


def model_step(cfg, params, tokens: np.ndarray):
  """The bare model: cross-entropy over the same positions, value_and_grad, optax AdamW."""
  model = transformer.Transformer(cfg)
  batch = shifted_batch(tokens)
  tx = optax.adamw(1e-4)

  @jax.jit
  def train(p, opt_state):
    def loss_fn(p):
      _, aux = model.apply({"params": p}, batch["inputs"], return_hidden=True)
      return losses.head_next_token_loss(aux["hidden"], p["lm_head"], batch["targets"], batch["loss_mask"])[0]
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, opt_state = tx.update(grads, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, loss

  state = [params, tx.init(params)]

  def step():
    state[0], state[1], loss = train(*state)
    return float(loss)
  return step


# ---------------------------------------------------------------------------------- parts
def part_closures(cfg, params, hf_model, tokens: np.ndarray) -> dict:
  """Forward + backward of each part alone, ours and transformers', on the same inputs."""
  b, s = tokens.shape
  d = cfg.hidden_size
  rng = np.random.default_rng(1)
  x = rng.normal(size=(b, s, d)).astype(np.float32)
  cot = rng.normal(size=(b, s, d)).astype(np.float32)
  targets = shifted_batch(tokens)
  positions = jnp.asarray(targets["positions"])
  tx, xt, cott = torch.tensor(x, requires_grad=True), torch.tensor(x), torch.tensor(cot)
  hm = hf_model.model
  cos_sin = hm.rotary_emb(xt, torch.arange(s)[None].expand(b, s))

  def ours(fn, p):
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(fn(p, x) * cot), argnums=(0, 1)))
    xj = jnp.asarray(x)
    return lambda: jax.block_until_ready(grad(p, xj))

  def theirs(fn):
    def run():
      tx.grad = None
      fn(tx).backward(cott)
    return run

  def head(p, x):                                   # as the stage's objective
    return losses.head_next_token_loss(x, p, targets["targets"], targets["loss_mask"])[0] * jnp.ones_like(x)

  def hf_head(x):
    loss = torch.nn.functional.cross_entropy((x @ hf_model.lm_head.weight.T)[:, :-1].reshape(-1, cfg.vocab_size),
                                             torch.as_tensor(tokens[:, 1:]).reshape(-1))
    return loss * torch.ones_like(x)

  mla = attention.MLA(cfg)
  mlp = layers.MLP(d, cfg.intermediate_size, std=cfg.initializer_range)
  routed = moe.MoE(cfg)
  adam = optax.adamw(1e-4)
  grads = jax.tree.map(jnp.ones_like, params)
  adam_state = adam.init(params)
  adam_update = jax.jit(lambda p, s: optax.apply_updates(p, adam.update(grads, s, p)[0]))
  torch_adam = torch.optim.AdamW(hf_model.parameters(), lr=1e-4)

  def hf_adam():
    for p in hf_model.parameters():
      p.grad = torch.ones_like(p)
    torch_adam.step()

  return {
      ("head+loss", "k25jax"): ours(head, params["lm_head"]),
      ("head+loss", PEER): theirs(hf_head),
      ("attention", "k25jax"): ours(lambda p, x: mla.apply({"params": p}, x, positions)[0],
                                    params["layers_1"]["self_attn"]),
      ("attention", PEER): theirs(lambda x: hm.layers[1].self_attn(x, cos_sin, None)[0]),
      ("moe layer", "k25jax"): ours(lambda p, x: routed.apply({"params": p}, x)[0], params["layers_1"]["mlp"]),
      ("moe layer", PEER): theirs(lambda x: hm.layers[1].mlp(x)),
      ("dense mlp", "k25jax"): ours(lambda p, x: mlp.apply({"params": p}, x), params["layers_0"]["mlp"]),
      ("dense mlp", PEER): theirs(lambda x: hm.layers[0].mlp(x)),
      ("adamw update", "k25jax"): lambda: jax.block_until_ready(adam_update(params, adam_state)),
      ("adamw update", PEER): hf_adam,
  }


def moe_layer_flops(n_experts: int, top_k: int, tokens: int) -> dict[str, float]:
  """Compiled flops of one routed-expert layer (router + experts) vs the analytic active count."""
  cfg = model_config.preset("tiny", n_routed_experts=n_experts, num_experts_per_tok=top_k, moe_impl="ragged",
                            n_shared_experts=0)
  layer = moe.MoE(cfg)
  x = jax.ShapeDtypeStruct((1, tokens, cfg.hidden_size), jnp.float32)
  variables = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)
  compiled = jax.jit(lambda v, x: layer.apply(v, x)[0]).lower(variables, x).compile()
  flops = float(compiled.cost_analysis()["flops"])
  d, f = cfg.hidden_size, cfg.moe_intermediate_size
  analytic = tokens * (top_k * 3 * 2 * d * f + 2 * d * n_experts)
  return {"experts": n_experts, "top_k": top_k, "tokens": tokens, "compiled_flops": flops,
          "analytic_flops": analytic, "ratio": flops / analytic}


# ---------------------------------------------------------------------------------- a run
def one_process(args) -> dict:
  """The contenders (and parts) timed in this process."""
  torch.set_num_threads(os.cpu_count())
  tokens = np.random.default_rng(0).integers(0, REFERENCE["vocab_size"], size=(args.batch, args.seq))
  peer, eager = hf_models("grouped_mm"), hf_models("eager")
  with tempfile.TemporaryDirectory() as path:
    peer.save_pretrained(path)
    cfg, params = hf.load(path, moe_impl="ragged")
  steps = {PEER: hf_step(peer, tokens), f"{PEER} eager": hf_step(eager, tokens),
           "k25jax stage": stage_step(cfg, params, tokens), "k25jax model": model_step(cfg, params, tokens)}
  first = {name: step() for name, step in steps.items()}            # the same loss, or no benchmark
  for name, loss in first.items():
    if abs(loss - first[PEER]) > 1e-5 * abs(first[PEER]):
      raise SystemExit(f"{name}'s first loss {loss!r} differs from {PEER}'s {first[PEER]!r}: not the same computation")
  times, others = interleave.round_robin(steps, args.steps, args.warmup)
  out = {"first_loss": first, "other_cores": others, "times": times,
         "page_faults": interleave.minor_page_faults(steps)}
  if args.parts:
    parts = part_closures(cfg, params, peer, tokens)
    part_times, part_others = interleave.round_robin(
        {f"{part}|{who}": fn for (part, who), fn in parts.items()}, args.steps, args.warmup)
    out["parts"], out["parts_other_cores"] = part_times, part_others
  return out


def part_table(runs: list[dict], summary: dict, max_load: float) -> dict:
  """Per part, the median over unloaded processes of each side's median; the stage's overhead."""
  use = [r for r in runs if r["parts_other_cores"] <= max_load] or runs
  parts = {}
  for key in runs[0]["parts"]:
    part, who = key.split("|")
    parts.setdefault(part, {})[who] = statistics.median(statistics.median(r["parts"][key]) for r in use)
  stage, model_ = (summary["contenders"][n]["median_s"] for n in ("k25jax stage", "k25jax model"))
  parts["stage overhead (stage step - model step)"] = {"k25jax": stage - model_}
  return parts


def print_table(summary: dict, args) -> None:
  print(f"tiny K2 decoder, train step on batch {args.batch} x seq {args.seq}, CPU ({os.cpu_count()} cores), "
        f"{len(summary['other_cores'])} process(es) x {args.steps} interleaved steps; other processes used "
        + ", ".join(f"{c:.2f}" for c in summary["other_cores"]) + " cores")
  print(f"{'contender':22s} {'step s':>8s} {'tok/s':>8s} {'vs best transformers':>21s} {'page faults':>12s}  "
        f"per process (best: {summary['peer']})")
  for name, row in summary["contenders"].items():
    print(f"{name:22s} {row['median_s']:8.3f} {row['per_s']:8.0f} {row['speed_vs_peer']:20.2f}x "
          f"{row['page_faults']:12d}  " + " ".join(f"{r:.2f}" for r in row["speed_vs_peer_per_process"]))
  if "parts" in summary:
    print(f"\n{'part (fwd+bwd)':42s} {'k25jax s':>9s} {PEER + ' s':>15s} {'ratio':>7s}")
    for part, row in summary["parts"].items():
      ours, theirs = row.get("k25jax", float("nan")), row.get(PEER, float("nan"))
      print(f"{part:42s} {ours:9.3f} {theirs:15.3f} {theirs / ours:6.2f}x")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--steps", type=int, default=7)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--parts", action="store_true", help="also time each part alone")
  interleave.add_process_arguments(parser)
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "bench_forward.json"))
  args = parser.parse_args()
  runs = interleave.runs_or_child(__file__, args, one_process,
                                  [f"--batch={args.batch}", f"--seq={args.seq}", f"--steps={args.steps}",
                                   f"--warmup={args.warmup}"] + (["--parts"] if args.parts else []))
  if runs is None:
    return
  summary = interleave.summarize(runs, [PEER, f"{PEER} eager"], args.batch * args.seq, args.max_load)
  for name, row in summary["contenders"].items():
    row["page_faults"] = int(statistics.median(r["page_faults"][name] for r in runs))
  if args.parts:
    summary["parts"] = part_table(runs, summary, args.max_load)
  print_table(summary, args)
  summary["moe_flops"] = [moe_layer_flops(16, 4, args.batch * args.seq), moe_layer_flops(384, 8, args.batch * args.seq)]
  print(f"\n{'MoE layer flops':16s} {'experts':>8s} {'top-k':>6s} {'compiled GF':>12s} {'analytic GF':>12s} {'ratio':>7s}")
  for row in summary["moe_flops"]:
    print(f"{'ragged':16s} {row['experts']:8d} {row['top_k']:6d} {row['compiled_flops'] / 1e9:12.2f} "
          f"{row['analytic_flops'] / 1e9:12.2f} {row['ratio']:7.2f}")
  result = {"batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "processes": args.processes, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "jax": jax.__version__, "torch": torch.__version__, "runs": runs, **summary}
  interleave.write_unless_loaded(args.out, result, args.allow_load)


if __name__ == "__main__":
  main()
