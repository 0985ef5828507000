"""Compile one full train step for a TPU pod on this CPU: per-chip memory, flops, collectives.

    pip install -e ".[tpu]"     # libtpu: the TPU compiler, no TPU needed
    python experiments/aot_compile.py --config=configs/pretrain.py:k25 --topology=v5p:8x8x8 \
        --mesh=fsdp=8,expert=64 --mesh=fsdp=4,expert=128 --remat=full [--set train.batch=1024]

`jax.experimental.topologies.get_topology_desc` describes the pod's chips without any
attached, and `jit(step).lower(abstract state, abstract batch).compile()` runs the TPU
compiler for them. The step is the stage's own (`k25jax.stages.pretrain.make_step`):
forward, backward, the optimizer (MuonClip with QK-Clip for `optimizer.name=muonclip`)
and the router-bias update, with the state donated. The config's "auto" choices are
resolved for the target as a run on it would: `ep_dispatch` → ragged_all_to_all,
`attention_impl` → pallas.

For every layout (mesh × remat policy; with no `--mesh`, the config's own `mesh`) it
prints per-chip bytes — arguments, temporaries and total = arguments + outputs − aliased
(donated) + temporaries + code — against the chip's HBM, the compiled flops per chip and
step, the collectives of the optimized HLO (static op counts: a scanned layer body counts
once) and the compile time here, and writes the table to experiments/results/aot_compile.json.

Exit status 1 when a layout fails to compile or does not fit the chip's HBM; such a run
writes its table only where `--out` says (never over the committed result by default).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import sys
import time

# Compile-only: the local backend is the CPU, and libtpu may be loaded by several processes.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from k25jax.model import config as model_config  # noqa: E402
from k25jax.model import expert_parallel, transformer  # noqa: E402
from k25jax.stages import pretrain  # noqa: E402
from k25jax.train import config_utils, optimizer, sharding, trainer as trainer_lib  # noqa: E402

# HBM per chip in bytes, by `device_kind`.
HBM = {"TPU v5": 95e9, "TPU v5p": 95e9, "TPU v5 lite": 16e9, "TPU v5e": 16e9, "TPU v4": 32e9,
       "TPU v6 lite": 32e9, "TPU v6e": 32e9}
COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter", "all-reduce",
               "collective-permute")
DEFAULT_OUT = os.path.join(ROOT, "experiments", "results", "aot_compile.json")
BATCH_FIELDS = {"inputs": jnp.int32, "targets": jnp.int32, "positions": jnp.int32, "segment_ids": jnp.int32,
                "loss_mask": jnp.float32}


def parse_mesh(text: str) -> dict[str, int]:
  """"fsdp=8,expert=64" → {"fsdp": 8, "expert": 64}."""
  sizes = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    if not value:
      raise ValueError(f"--mesh {text!r}: expected axis=size pairs, e.g. fsdp=8,expert=64")
    sizes[name.strip()] = int(value)
  return sizes


def requested_layouts(meshes: list[str] | None, config) -> list[dict[str, int]]:
  """The layouts of the `--mesh` flags, or the config's own `mesh` when there are none."""
  return [parse_mesh(m) for m in meshes] if meshes else [config.mesh.to_dict()]


def collective_counts(hlo_text: str) -> dict[str, int]:
  """Static counts of each collective in an optimized HLO module (async start ops count once)."""
  counts = {}
  for name in COLLECTIVES:
    counts[name] = len(re.findall(rf"= [^=]*? {re.escape(name)}(?:-start)?\(", hlo_text))
  return counts


def target_model_config(section, platform: str) -> model_config.ModelConfig:
  """The model config with its "auto" choices made for `platform` (not for this CPU)."""
  cfg = config_utils.model_config_from(section)
  accelerator = platform in ("tpu", "gpu")
  changes = {}
  if cfg.ep_dispatch == "auto":
    changes["ep_dispatch"] = "ragged_all_to_all" if accelerator else "all_to_all"
  if cfg.attention_impl == "auto":
    changes["attention_impl"] = "pallas" if accelerator else "xla"
  return cfg.replace(**changes)


def abstract_batch(batch: int, seq_len: int, mesh) -> dict:
  spec = sharding.batch_sharding(mesh)
  return {name: jax.ShapeDtypeStruct((batch, seq_len), dtype, sharding=spec) for name, dtype in BATCH_FIELDS.items()}


def compile_step(config, devices, mesh_sizes: dict, remat: str, compiler_options: dict | None = None) -> dict:
  """Compiles the stage's train step for `devices` laid out as `mesh_sizes`; returns the row."""
  config = copy.deepcopy(config)
  config.model.remat_policy = remat
  cfg = target_model_config(config.model, devices[0].platform)
  mesh = sharding.make_mesh(mesh_sizes, devices)
  shards = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
  if config.train.batch % shards:
    raise ValueError(f"train.batch={config.train.batch} does not divide over {shards} batch shards")
  model = transformer.Transformer(cfg)
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    expert_parallel.check_layout(cfg, HBM.get(devices[0].device_kind))
    state = trainer_lib.state_target(model, tx, mesh)   # ShapeDtypeStructs with shardings, nothing allocated
    step = pretrain.make_step(config, model, tx)
    lowered = step.lower(state, abstract_batch(config.train.batch, config.train.seq_len, mesh))
    compiled = lowered.compile(compiler_options)
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
           + memory.temp_size_in_bytes + memory.generated_code_size_in_bytes)
  hbm = HBM.get(devices[0].device_kind)
  return {
      "mesh": {k: v for k, v in mesh.shape.items() if v > 1}, "remat": remat,
      "argument_bytes": memory.argument_size_in_bytes, "output_bytes": memory.output_size_in_bytes,
      "alias_bytes": memory.alias_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
      "code_bytes": memory.generated_code_size_in_bytes, "total_bytes": total, "hbm_bytes": hbm,
      "fits": None if hbm is None else total <= hbm,
      "flops_per_chip": float(cost.get("flops", math.nan)), "compile_seconds": seconds,
      "collectives": collective_counts(compiled.as_text()),
      "model": {"scan_layers": cfg.scan_layers, "moe_impl": cfg.moe_impl, "ep_dispatch": cfg.ep_dispatch,
                "attention_impl": cfg.attention_impl, "param_dtype": cfg.param_dtype, "dtype": cfg.dtype,
                "ep_capacity_factor": cfg.ep_capacity_factor},
  }


def analytic_flops(cfg: model_config.ModelConfig, batch: int, seq_len: int) -> float:
  """6 · active params · tokens + causal attention (12 · layers · heads · head dims · s² / 2 per row)."""
  active = model_config.param_counts(cfg)["active"]
  attention = (6 * cfg.num_hidden_layers * cfg.num_attention_heads
               * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len * seq_len * batch) // 2
  return 6.0 * active * batch * seq_len + attention


def table(rows: list[dict]) -> str:
  gb = lambda b: f"{b / 1e9:7.1f}"
  lines = [f"{'mesh':28s} {'remat':13s} {'args GB':>8s} {'temp GB':>8s} {'total GB':>9s} {'HBM GB':>7s} "
           f"{'fits':>5s} {'TFLOP/chip':>10s} {'compile s':>9s}  collectives (a2a/ragged/ag/rs/ar/cp)"]
  for r in rows:
    if "error" in r:
      lines.append(f"{_mesh_name(r['mesh']):28s} {r['remat']:13s} failed: {r['error'][:120]}")
      continue
    c = r["collectives"]
    lines.append(
        f"{_mesh_name(r['mesh']):28s} {r['remat']:13s} {gb(r['argument_bytes']):>8s} {gb(r['temp_bytes']):>8s} "
        f"{gb(r['total_bytes']):>9s} {gb(r['hbm_bytes'] or math.nan):>7s} {str(r['fits']):>5s} "
        f"{r['flops_per_chip'] / 1e12:10.1f} {r['compile_seconds']:9.0f}  "
        + "/".join(str(c[n]) for n in COLLECTIVES))
  return "\n".join(lines)


def _mesh_name(mesh: dict) -> str:
  return ",".join(f"{k}={v}" for k, v in mesh.items()) or "1 device"


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/pretrain.py:k25", help="config file[:preset]")
  parser.add_argument("--topology", default="v5p:8x8x8", help="TPU topology, e.g. v5p:8x8x8 (512 chips)")
  parser.add_argument("--mesh", action="append",
                      help="axis=size,... (repeat for several layouts; default: the config's mesh)")
  parser.add_argument("--remat", default="", help="comma-separated remat policies (default: the config's)")
  parser.add_argument("--set", action="append", default=[], help="config overrides, e.g. train.batch=1024")
  parser.add_argument("--out", default=None, help=f"where to write the table (default {DEFAULT_OUT}, "
                                                   "only when every layout compiles and fits)")
  args = parser.parse_args()

  path, _, preset = args.config.partition(":")
  config = config_utils.load_config_file(os.path.join(ROOT, path) if not os.path.isabs(path) else path,
                                         preset or None)
  config_utils.apply_overrides(config, args.set)
  topology = topologies.get_topology_desc(args.topology, "tpu")
  devices = topology.devices
  layouts = requested_layouts(args.mesh, config)
  remats = [r for r in args.remat.split(",") if r] or [config.model.remat_policy]
  cfg = config_utils.model_config_from(config.model)
  print(f"{args.config} on {args.topology}: {len(devices)} × {devices[0].device_kind}; global batch "
        f"{config.train.batch} × {config.train.seq_len} = {config.train.batch * config.train.seq_len:,} tokens; "
        f"{model_config.param_counts(cfg)['total'] / 1e9:.1f}B params; optimizer {config.optimizer.name}",
        flush=True)
  rows = []
  for mesh_sizes in layouts:
    for remat in remats:
      try:
        row = compile_step(config, devices, mesh_sizes, remat)
      except Exception as e:  # pylint: disable=broad-except  (a layout that does not compile is a result)
        row = {"mesh": mesh_sizes, "remat": remat, "error": f"{type(e).__name__}: {e}"}
      rows.append(row)
      print(table([row]).splitlines()[-1], flush=True)
  flops = analytic_flops(cfg, config.train.batch, config.train.seq_len)
  print("\n" + table(rows))
  print(f"\nanalytic flops per step: {flops:.3e} ({flops / len(devices) / 1e12:.1f} TFLOP per chip); "
        "collective counts are static (a scanned layer body counts once)")
  result = {"config": args.config, "topology": args.topology, "chips": len(devices),
            "device_kind": devices[0].device_kind, "overrides": args.set, "global_batch": config.train.batch,
            "seq_len": config.train.seq_len, "analytic_flops_per_step": flops, "layouts": rows,
            "jax": jax.__version__}
  failed = [_mesh_name(r["mesh"]) for r in rows if "error" in r or r["fits"] is False]
  if args.out or not failed:
    out = args.out or DEFAULT_OUT
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {out}")
  if failed:
    print(f"{len(failed)} layout(s) failed to compile or do not fit the chip's HBM: {'; '.join(failed)}"
          + ("" if args.out else " (nothing written; pass --out to keep this table)"), file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  main()
