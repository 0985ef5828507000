"""Experiment: QK-Clip keeps attention logits bounded (Kimi K2, Fig. 2), at tiny scale on CPU.

    python experiments/qk_clip.py [--steps 300 --lr 0.02 --tau 20 --out experiments/results/qk_clip]

Trains the same small K2 decoder three times on the same batches of byte-level text
(Python's standard library), with an aggressive learning rate: AdamW, Muon (MuonClip's
update with τ = ∞) and MuonClip (τ = --tau). Records each step's largest pre-softmax
attention logit S_max (over layers and heads, measured in the step's forward pass) and
the training loss; writes `<out>.json` and a plot `<out>.png`.

QK-Clip rescales with the logits of the step's forward pass, measured before that step's
update and on that step's batch, so the next forward can exceed τ by one update's growth
(and by batch-to-batch variation): S_max hovers just above τ instead of exploding.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import matplotlib
import numpy as np
import optax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from k25jax import losses  # noqa: E402
from k25jax.data import pipeline, sources, tokenizer  # noqa: E402
from k25jax.model import config, transformer  # noqa: E402
from k25jax.optim import muonclip, partition  # noqa: E402
from k25jax.train import optimizer as train_optimizer  # noqa: E402
from k25jax.train import step as train_step  # noqa: E402

MODEL = dict(vocab_size=259, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
             num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, n_routed_experts=8,
             num_experts_per_tok=2, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, moe_impl="dense")
RUNS = ("adamw", "muon", "muonclip")


def batches(n: int, batch: int, seq_len: int) -> list[dict]:
  """The first n packed batches of the standard-library text, the same for every run."""
  docs = sources.load("python_stdlib", 1000)
  ds = pipeline.lm_dataset(docs, tokenizer.ByteTokenizer(), seq_len=seq_len, batch=batch, seed=0,
                           max_doc_tokens=1002)
  return pipeline.take(ds, n)


def make_tx(run: str, schedule, weight_decay: float) -> optax.GradientTransformation:
  """AdamW on every trained param, or MuonClip's update; the router bias frozen in both."""
  if run == "adamw":
    adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay,
                        mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    inner = optax.partition({partition.MUON: adamw, partition.ADAMW: adamw, partition.FROZEN: optax.set_to_zero()},
                            partition.labels)
  else:
    inner = muonclip.muonclip(schedule, weight_decay=weight_decay)
  return optax.chain(optax.clip_by_global_norm(1.0), inner)


def train(run: str, data: list[dict], cfg, args) -> dict:
  model = transformer.Transformer(cfg)
  schedule = train_optimizer.wsd_schedule(args.lr, len(data), args.warmup, 0, 1.0)
  tx = make_tx(run, schedule, args.weight_decay)
  tau = args.tau if run == "muonclip" else float("inf")

  def loss_fn(params, batch):
    logits, aux = model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"])
    loss, _ = losses.next_token_loss(logits, batch["targets"], batch["loss_mask"])
    return loss + 1e-4 * aux["balance_loss"], aux

  @jax.jit
  def step(params, opt_state, batch):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    params = train_step.update_router_biases(params, aux["expert_load"], 1e-3, cfg.first_k_dense_replace)
    params, clip = muonclip.qk_clip(params, aux["max_logits"], tau)
    return params, opt_state, {"loss": loss, "max_logit": clip["max_logit"],
                               "clipped_heads": clip["clipped_heads"]}

  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  opt_state = tx.init(params)
  history = {"loss": [], "max_logit": [], "clipped_heads": []}
  start = time.perf_counter()
  for batch in data:
    params, opt_state, metrics = step(params, opt_state, batch)
    for name, value in jax.device_get(metrics).items():
      history[name].append(float(value))
  history["seconds"] = time.perf_counter() - start
  return history


def summary(history: dict, last: int, tau: float) -> dict:
  s_max = np.asarray(history["max_logit"])
  return {"max_logit_peak": float(s_max.max()), f"max_logit_median_last_{last}": float(np.median(s_max[-last:])),
          f"loss_mean_last_{last}": float(np.mean(history["loss"][-last:])),
          "steps_over_tau": int(np.sum(s_max > tau)),
          "steps_with_clipping": int(np.sum(np.asarray(history["clipped_heads"]) > 0)),
          "seconds": history["seconds"]}


def plot(results: dict, tau: float, path: str) -> None:
  fig, (ax_logit, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
  for run, history in results.items():
    steps = np.arange(1, len(history["loss"]) + 1)
    ax_logit.plot(steps, history["max_logit"], label=run)
    ax_loss.plot(steps, history["loss"], label=run, alpha=0.8)
  ax_logit.axhline(tau, color="k", ls="--", lw=0.8, label=f"τ = {tau:g}")
  ax_logit.set(xlabel="step", ylabel="max attention logit S_max", title="Largest pre-softmax logit", yscale="log")
  ax_loss.set(xlabel="step", ylabel="train loss (nats/byte)", title="Training loss", yscale="log")
  for ax in (ax_logit, ax_loss):
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--lr", type=float, default=0.02)
  parser.add_argument("--warmup", type=int, default=20)
  parser.add_argument("--weight_decay", type=float, default=0.0)
  parser.add_argument("--tau", type=float, default=20.0)
  parser.add_argument("--out", default="experiments/results/qk_clip")
  args = parser.parse_args()

  cfg = config.preset("tiny", **MODEL)
  data = batches(args.steps, args.batch, args.seq)
  results = {run: train(run, data, cfg, args) for run in RUNS}
  table = {run: summary(history, 100, args.tau) for run, history in results.items()}
  print(f"{'run':10s} {'peak S_max':>11s} {'median S_max':>13s} {'loss':>7s} {'steps > tau':>12s} "
        f"{'clipped steps':>14s} {'seconds':>8s}   (median and loss over the last 100 steps)")
  for run, row in table.items():
    print(f"{run:10s} {row['max_logit_peak']:11.2f} {row['max_logit_median_last_100']:13.2f} "
          f"{row['loss_mean_last_100']:7.4f} {row['steps_over_tau']:12d} {row['steps_with_clipping']:14d} "
          f"{row['seconds']:8.1f}")
  with open(args.out + ".json", "w") as f:
    json.dump({"args": vars(args), "model": MODEL, "summary": table, "history": results}, f, indent=1)
  plot(results, args.tau, args.out + ".png")
  print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
  main()
