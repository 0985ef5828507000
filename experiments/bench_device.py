"""Accelerator benchmark: the pretrain stage's train step with the Pallas kernels against the
same step on XLA paths, its model-flop utilisation, and the kernels alone.

    python experiments/bench_device.py            # on a GPU or TPU: preset small, bfloat16

One run, for when a GPU or TPU is lent (a few minutes):
* the train step of `configs/pretrain.py:<preset>` (`pretrain.make_step`: forward, backward,
  the optimizer, router-bias update, QK-Clip when MuonClip), built twice from the same
  initial params, `pallas` (attention_impl=pallas, moe_impl=pallas) and `xla`
  (attention_impl=xla, moe_impl=ragged_dot); both first losses must agree (bf16, 2%) before
  they are timed interleaved (`interleave.round_robin`, the load beside them recorded);
* MFU = (6·N·T + A) / step time / peak, with N the matmul params a token activates (the
  top-k experts, the head; not the embedding lookup), T the tokens of a step and A the
  causal attention flops, 3 · Σ_layers 2·b·h·s(s+1)/2·(d_qk + d_v) (forward and backward,
  no recompute counted); the peak is the chip's dense bfloat16 rate (`PEAK_BF16`, or
  `--peak_tflops`);
* `experiments/bench_kernels.py --presets <preset>` in a subprocess: each kernel against its
  XLA path and the platform's peers, values in `bench_kernels_<platform>.json`.

On a CPU the Pallas kernels would run in the interpreter (timings meaningless): only the
`xla` step is timed there, and no MFU is given unless `--peak_tflops` is; `--preset tiny`
makes it a quick check that the script works. Writes `<out>` (JSON).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys

import jax
import numpy as np

import interleave  # experiments/interleave.py, beside this script
from k25jax.model import config as model_config
from k25jax.model import transformer
from k25jax.stages import pretrain
from k25jax.train import config_utils, optimizer, sharding, trainer as trainer_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"pallas": dict(attention_impl="pallas", moe_impl="pallas"),
            "xla": dict(attention_impl="xla", moe_impl="ragged_dot")}
FIRST_LOSS_RTOL = 2e-2          # bfloat16 activations: the two paths round differently
PEAK_BF16 = {                   # dense bfloat16 FLOP/s per chip, vendors' figures
    "NVIDIA H200": 989e12, "NVIDIA H100": 989e12, "NVIDIA A100": 312e12,
    "TPU v6 lite": 918e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v4": 275e12,
}


def peak_flops(device_kind: str, override_tflops: float | None) -> float | None:
  """The chip's dense bf16 peak: the override, else the longest `PEAK_BF16` name the kind starts with."""
  if override_tflops:
    return override_tflops * 1e12
  names = [name for name in PEAK_BF16 if device_kind.startswith(name)]
  return PEAK_BF16[max(names, key=len)] if names else None


def step_flops(cfg: model_config.ModelConfig, batch: int, seq: int) -> dict[str, float]:
  """6·N·T (N: activated matmul params, the embedding lookup left out) and the causal attention A."""
  matmul_params = model_config.param_counts(cfg)["active"] - cfg.vocab_size * cfg.hidden_size
  tokens = batch * seq
  attention = 3 * cfg.num_hidden_layers * 2 * batch * cfg.num_attention_heads * seq * (seq + 1) / 2 * (
      cfg.qk_head_dim + cfg.v_head_dim)
  return {"dense": 6 * matmul_params * tokens, "attention": attention, "total": 6 * matmul_params * tokens + attention}


def random_batch(batch: int, seq: int, vocab: int, mesh) -> dict:
  """Random tokens as the stage's rows: targets shifted, the last position unscored."""
  tokens = np.random.default_rng(0).integers(0, vocab, size=(batch, seq + 1))
  rows = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.tile(np.arange(seq), (batch, 1)),
          "segment_ids": np.ones((batch, seq)), "loss_mask": np.ones((batch, seq))}
  dtypes = {"loss_mask": np.float32}
  return jax.device_put({k: v.astype(dtypes.get(k, np.int32)) for k, v in rows.items()},
                        sharding.batch_sharding(mesh))


def build_step(config, variant: dict, mesh, batch: dict):
  """(model config, a closure running one step and returning its cross-entropy) for one variant."""
  section = copy.deepcopy(config.model)
  section.update(variant)
  cfg = config_utils.model_config_from(section)
  model = transformer.Transformer(cfg)
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  with jax.set_mesh(mesh):
    state = [trainer_lib.new_state(model, tx, mesh, config.train.seed)]
    step = pretrain.make_step(config, model, tx)

  def run():
    with jax.set_mesh(mesh):
      state[0], metrics = step(state[0], batch)
    return float(metrics["cross_entropy"])
  return cfg, run


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="small", help="a preset of configs/pretrain.py")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--peak_tflops", type=float, default=None, help="the chip's dense bf16 peak, if not known")
  parser.add_argument("--no_kernels", action="store_true", help="skip bench_kernels.py")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "bench_device.json"))
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  accelerator = device.platform in ("tpu", "gpu")
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "pretrain.py"), args.preset)
  mesh = sharding.make_mesh(config.mesh.to_dict(), jax.devices())
  batch = random_batch(args.batch, args.seq, config.model.vocab_size, mesh)
  variants = VARIANTS if accelerator else {"xla": VARIANTS["xla"]}
  steps, cfgs = {}, {}
  for name, variant in variants.items():
    cfgs[name], steps[name] = build_step(config, variant, mesh, batch)
  first = {name: run() for name, run in steps.items()}
  base = first["xla"]
  for name, loss in first.items():
    if abs(loss - base) > FIRST_LOSS_RTOL * abs(base):
      raise SystemExit(f"the {name} step's first loss {loss!r} differs from the xla step's {base!r}")
  times, other_cores = interleave.round_robin(steps, args.steps, args.warmup)

  flops = step_flops(cfgs["xla"], args.batch, args.seq)
  peak = peak_flops(device.device_kind, args.peak_tflops)
  print(f"{device.device_kind} x{jax.device_count()} ({device.platform}); configs/pretrain.py:{args.preset}, "
        f"{cfgs['xla'].dtype}, batch {args.batch} x {args.seq}; {args.steps} interleaved steps; other processes used "
        f"{other_cores:.2f} cores; step {flops['total'] / 1e12:.2f} TFLOP (attention {flops['attention'] / 1e12:.2f})")
  rows = {}
  for name, ts in times.items():
    median = statistics.median(ts)
    mfu = flops["total"] / median / (peak * jax.device_count()) if peak else None
    rows[name] = {"median_s": median, "times_s": ts, "tokens_per_s": args.batch * args.seq / median,
                  "first_loss": first[name], "mfu": mfu}
    print(f"  {name:7s} {1e3 * median:9.1f} ms  {rows[name]['tokens_per_s']:10.0f} tok/s  "
          + (f"MFU {100 * mfu:5.1f}%" if mfu is not None else "MFU n/a (no peak known for this device)"))
  if "pallas" in rows:
    print(f"  pallas step / xla step: {rows['xla']['median_s'] / rows['pallas']['median_s']:.2f}x")
  if not accelerator:
    print("  (CPU: the Pallas step is not timed; its kernels would run in the interpreter)")

  kernels_out = os.path.join(os.path.dirname(os.path.abspath(args.out)), f"bench_kernels_{device.platform}.json")
  if accelerator and not args.no_kernels:
    subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "bench_kernels.py"), f"--presets={args.preset}",
                    f"--out={kernels_out}", "--allow_load"], check=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"device": device.device_kind, "platform": device.platform, "devices": jax.device_count(),
               "preset": args.preset, "dtype": cfgs["xla"].dtype, "batch": args.batch, "seq": args.seq,
               "steps": args.steps, "other_cores": other_cores, "flops_per_step": flops, "peak_flops": peak,
               "variants": {name: variants[name] for name in rows}, "rows": rows, "jax": jax.__version__,
               "kernels": kernels_out if accelerator and not args.no_kernels else None}, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
