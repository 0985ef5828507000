"""Compile one full train step for a TPU pod on this CPU: per-chip memory, flops, collectives.

    pip install -e ".[tpu]"     # libtpu: the TPU compiler, no TPU needed
    python experiments/aot_compile.py --config=configs/pretrain.py:k25 --topology=v5p:8x8x8 \
        --mesh=fsdp=8,expert=64 --mesh=fsdp=4,expert=128 --remat=full [--set train.batch=1024]
    python experiments/aot_compile.py --config=configs/midtrain.py:k25 --topology=v5p:8x8x8
    python experiments/aot_compile.py --config=configs/rl.py:k25 --topology=v5p:8x8x8
    python experiments/aot_compile.py --config=configs/pretrain.py:k25,joint --topology=v5p:8x8x8

`jax.experimental.topologies.get_topology_desc` describes the pod's chips without any
attached, and `jit(step).lower(abstract state, abstract batch).compile()` runs the TPU
compiler for them. The step is the stage's own (`config.stage`), with the state donated:

    pretrain  k25jax.stages.pretrain.make_step   the K2 decoder on [batch, seq_len] rows
    pretrain  k25jax.train.joint.make_step       (a K2.5 model section, `pretrain.py:k25,joint`)
                                                 the K2.5 model on joint rows with their media:
                                                 with data.shard_media, pixel_values
                                                 [D, P/D, 3, 14, 14] and the patch layout split
                                                 over the D data shards with the rows
    midtrain  k25jax.train.joint.make_step       the K2.5 model with the stage's YaRN
                                                 (stages.midtrain.long_context_model) on
                                                 text-only rows (the step with media: the
                                                 K2.5 pretrain above)
    rl        k25jax.rl.driver.update_step       the policy loss (loss.name) on one update's
                                                 loss rows: rl.prompts_per_iteration ·
                                                 rl.num_generations / rl.minibatches rows as
                                                 wide as rl.max_new_tokens

each the forward, backward, the optimizer (MuonClip with QK-Clip for `optimizer.name=muonclip`)
and the router-bias update. The config's "auto" choices are resolved for the target as a run
on it would: `ep_dispatch` → ragged_all_to_all, `attention_impl` → pallas.

For every layout (mesh × remat policy; with no `--mesh`, the config's own `mesh`) it
prints per-chip bytes — arguments, temporaries and total = arguments + outputs − aliased
(donated) + temporaries + code — against the chip's HBM, the compiled flops per chip and
step, the collectives of the optimized HLO (static op counts: a scanned layer body counts
once) and the compile time here, and writes the table to experiments/results/aot_compile.json
(pretrain) or aot_compile_<stage>.json.

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

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from k25jax.data import tokenizer  # noqa: E402
from k25jax.model import config as model_config  # noqa: E402
from k25jax.model import expert_parallel, k25, transformer, vision  # noqa: E402
from k25jax.rl import driver  # noqa: E402
from k25jax.stages import midtrain, pretrain  # noqa: E402
from k25jax.train import config_utils, joint, optimizer, sharding, trainer as trainer_lib  # noqa: E402

# HBM per chip in bytes, by `device_kind`.
HBM = {"TPU v5": 95e9, "TPU v5p": 95e9, "TPU v5 lite": 16e9, "TPU v5e": 16e9, "TPU v4": 32e9,
       "TPU v6 lite": 32e9, "TPU v6e": 32e9}
COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter", "all-reduce",
               "collective-permute")
RESULTS = os.path.join(ROOT, "experiments", "results")
DEFAULT_OUT = os.path.join(RESULTS, "aot_compile.json")
ROWS = {"inputs": jnp.int32, "targets": jnp.int32, "positions": jnp.int32, "segment_ids": jnp.int32}
BATCH_FIELDS = {**ROWS, "loss_mask": jnp.float32}
JOINT_FIELDS = {**BATCH_FIELDS, "is_vision": jnp.float32}                     # k25jax.data.mixture.FEATURES
RL_FIELDS = {**ROWS, "mask": jnp.float32, "old_logp": jnp.float32, "advantages": jnp.float32,
             "rewards": jnp.float32}                                            # the driver's loss rows


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


def default_out(config) -> str:
  """aot_compile.json (text pretrain), aot_compile_joint.json (a K2.5 pretrain), else _<stage>."""
  if config.stage == "pretrain":
    return os.path.join(RESULTS, "aot_compile_joint.json") if "vision" in config.model else DEFAULT_OUT
  return os.path.join(RESULTS, f"aot_compile_{config.stage}.json")


def target_model_config(cfg: model_config.ModelConfig, platform: str) -> model_config.ModelConfig:
  """The decoder's config with its "auto" choices made for `platform` (not for this CPU)."""
  accelerator = platform in ("tpu", "gpu")
  changes = {}
  if cfg.ep_dispatch == "auto":
    changes["ep_dispatch"] = "ragged_all_to_all" if accelerator else "all_to_all"
  if cfg.attention_impl == "auto":
    changes["attention_impl"] = "pallas" if accelerator else "xla"
  return cfg.replace(**changes)


def text_section(config):
  """The decoder's fields of the config's `model` section (`model.text` of a K2.5 stage)."""
  return config.model.text if "text" in config.model else config.model


def stage_program(config, platform: str) -> dict:
  """What the stage compiles (module docstring): model, optimizer, `make_step()` (call it under
  the mesh), the batch's fields and its [rows, width]."""
  stage = config.stage
  if stage == "pretrain" and "vision" in config.model:
    cfg = config_utils.k25_config_from(config.model, tokenizer.load(config.data.tokenizer, config.data.vocab_file,
                                                                    media=True))
    model = k25.K25(cfg.replace(text=target_model_config(cfg.text, platform)))
    tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
    return dict(model=model, tx=tx, fields=JOINT_FIELDS, rows=config.train.batch, width=config.train.seq_len,
                media=config.data.max_patches, sharded_media=config.data.shard_media,
                make_step=lambda: joint.make_step(config, model, tx, True, config.data.shard_media))
  if stage == "pretrain":
    model = transformer.Transformer(target_model_config(config_utils.model_config_from(config.model), platform))
    tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
    return dict(model=model, tx=tx, make_step=lambda: pretrain.make_step(config, model, tx), fields=BATCH_FIELDS,
                rows=config.train.batch, width=config.train.seq_len)
  if stage == "midtrain":
    cfg = midtrain.long_context_model(config, tokenizer.load(config.data.tokenizer, config.data.vocab_file, media=True))
    model = k25.K25(cfg.replace(text=target_model_config(cfg.text, platform)))
    tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
    return dict(model=model, tx=tx, make_step=lambda: joint.make_step(config, model, tx, media=False),
                fields=JOINT_FIELDS, rows=config.train.batch, width=config.train.seq_len)
  if stage == "rl":
    model = transformer.Transformer(target_model_config(config_utils.model_config_from(config.model), platform))
    tx = driver.make_optimizer(config)
    rl = config.rl
    return dict(model=model, tx=tx, make_step=lambda: driver.update_step(config, model, tx), fields=RL_FIELDS,
                rows=rl.prompts_per_iteration * rl.num_generations // rl.minibatches, width=rl.max_new_tokens)
  raise ValueError(f"stage {stage!r}: experiments/aot_compile.py compiles the pretrain, midtrain and rl steps")


def abstract_batch(batch: int, seq_len: int, mesh, fields: dict = BATCH_FIELDS) -> dict:
  spec = sharding.batch_sharding(mesh)
  return {name: jax.ShapeDtypeStruct((batch, seq_len), dtype, sharding=spec) for name, dtype in fields.items()}


def abstract_media(cfg: model_config.K25Config, max_patches: int, mesh, sharded: bool) -> dict:
  """pixel_values and the patch layout of a budget of `max_patches` patches: [P, ...]
  replicated, or [D, P/D, ...] over the batch axes (D = the mesh's data shards)."""
  shards = sharding.batch_shards(mesh) if sharded else 1
  if max_patches % shards:
    raise ValueError(f"data.max_patches={max_patches} does not split over {shards} media shards")
  layout = vision.patch_layout([], cfg.vision, num_patches=max_patches // shards,
                               num_merged=max_patches // shards // cfg.vision.merge_size)
  pixels = np.zeros((max_patches // shards, 3, cfg.vision.patch_size, cfg.vision.patch_size), np.float32)
  lead = (shards,) if sharded else ()
  spec = NamedSharding(mesh, P(sharding.BATCH_AXES) if sharded else P())
  shape = lambda x: jax.ShapeDtypeStruct(lead + x.shape, x.dtype, sharding=spec)
  return {"pixel_values": shape(pixels), "layout": jax.tree.map(shape, layout)}


def measure(compiled, device, seconds: float) -> dict:
  """Per-chip bytes (total = arguments + outputs − aliased + temporaries + code) against the
  chip's HBM, compiled flops, collective counts, Pallas (Mosaic) kernel calls and the compile
  time of a compiled program."""
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
           + memory.temp_size_in_bytes + memory.generated_code_size_in_bytes)
  hbm = HBM.get(device.device_kind)
  text = compiled.as_text()
  return {
      "argument_bytes": memory.argument_size_in_bytes, "output_bytes": memory.output_size_in_bytes,
      "alias_bytes": memory.alias_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
      "code_bytes": memory.generated_code_size_in_bytes, "total_bytes": total, "hbm_bytes": hbm,
      "fits": None if hbm is None else total <= hbm,
      "flops_per_chip": float(cost.get("flops", math.nan)), "compile_seconds": seconds,
      "collectives": collective_counts(text), "pallas_calls": text.count('custom_call_target="tpu_custom_call"'),
  }


def model_fields(cfg: model_config.ModelConfig) -> dict:
  """The compute-path choices of the decoder a row was compiled with."""
  return {"scan_layers": cfg.scan_layers, "moe_impl": cfg.moe_impl, "ep_dispatch": cfg.ep_dispatch,
          "attention_impl": cfg.attention_impl, "param_dtype": cfg.param_dtype, "dtype": cfg.dtype,
          "ep_capacity_factor": cfg.ep_capacity_factor}


def compile_step(config, devices, mesh_sizes: dict, remat: str, compiler_options: dict | None = None) -> dict:
  """Compiles the stage's train step for `devices` laid out as `mesh_sizes`; returns the row."""
  config = copy.deepcopy(config)
  text_section(config).remat_policy = remat
  program = stage_program(config, devices[0].platform)
  mesh = sharding.make_mesh(mesh_sizes, devices)
  rows, width = program["rows"], program["width"]
  sharding.check_batch(mesh, rows, "the step's rows")
  if width % mesh.shape["sequence"]:
    raise ValueError(f"rows of {width} tokens do not divide over mesh.sequence={mesh.shape['sequence']}")
  model, tx = program["model"], program["tx"]
  cfg = trainer_lib.text_config(model)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    expert_parallel.check_layout(cfg, HBM.get(devices[0].device_kind))
    state = trainer_lib.state_target(model, tx, mesh)   # ShapeDtypeStructs with shardings, nothing allocated
    batch = abstract_batch(rows, width, mesh, program["fields"])
    if "media" in program:
      batch.update(abstract_media(model.cfg, program["media"], mesh, program["sharded_media"]))
    lowered = program["make_step"]().lower(state, batch)
    compiled = lowered.compile(compiler_options)
  row = {"mesh": {k: v for k, v in mesh.shape.items() if v > 1}, "remat": remat,
         **measure(compiled, devices[0], time.perf_counter() - start), "model": model_fields(cfg)}
  if cfg.rope_scaling:
    row["model"]["rope_scaling"] = dict(cfg.rope_scaling)
  return row


def analytic_flops(cfg: model_config.ModelConfig, batch: int, seq_len: int) -> float:
  """6 · active params · tokens + causal attention (12 · layers · heads · head dims · s² / 2 per row)."""
  active = model_config.param_counts(cfg)["active"]
  attention = (6 * cfg.num_hidden_layers * cfg.num_attention_heads
               * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len * seq_len * batch) // 2
  return 6.0 * active * batch * seq_len + attention


def analytic_vision_flops(cfg, patches: int) -> float:
  """The vision tower's and projector's matmuls over a step's patch budget N (padding included,
  as compiled): 6 · (tower kernels · N + projector kernels · N / merge). The block-diagonal
  attention's 12 · layers · width · Σ_items n² is left out: it depends on the items' sizes."""
  params = nn.meta.unbox(k25.abstract_params(cfg))
  kernels = lambda tree: sum(math.prod(x.shape) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
                             if getattr(path[-1], "key", None) == "kernel")
  return 6.0 * (kernels(params["vision_tower"]) * patches
                + kernels(params["mm_projector"]) * patches // cfg.vision.merge_size)


def table(rows: list[dict]) -> str:
  gb = lambda b: f"{b / 1e9:7.1f}"
  lines = [f"{'mesh':28s} {'remat':13s} {'args GB':>8s} {'temp GB':>8s} {'total GB':>9s} {'HBM GB':>7s} "
           f"{'fits':>5s} {'TFLOP/chip':>10s} {'compile s':>9s}  collectives (a2a/ragged/ag/rs/ar/cp)"]
  for r in rows:
    if "error" in r:
      lines.append(f"{mesh_name(r['mesh']):28s} {r['remat']:13s} failed: {r['error'][:120]}")
      continue
    c = r["collectives"]
    lines.append(
        f"{mesh_name(r['mesh']):28s} {r['remat']:13s} {gb(r['argument_bytes']):>8s} {gb(r['temp_bytes']):>8s} "
        f"{gb(r['total_bytes']):>9s} {gb(r['hbm_bytes'] or math.nan):>7s} {str(r['fits']):>5s} "
        f"{r['flops_per_chip'] / 1e12:10.1f} {r['compile_seconds']:9.0f}  "
        + "/".join(str(c[n]) for n in COLLECTIVES))
  return "\n".join(lines)


def mesh_name(mesh: dict) -> str:
  return ",".join(f"{k}={v}" for k, v in mesh.items()) or "1 device"


def load_config(spec: str, overrides: list[str]):
  """The config of "file[:preset]" (relative to the checkout) with `section.field=value` overrides."""
  path, _, preset = spec.partition(":")
  config = config_utils.load_config_file(path if os.path.isabs(path) else os.path.join(ROOT, path), preset or None)
  config_utils.apply_overrides(config, overrides)
  return config


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/pretrain.py:k25", help="config file[:preset]")
  parser.add_argument("--topology", default="v5p:8x8x8", help="TPU topology, e.g. v5p:8x8x8 (512 chips)")
  parser.add_argument("--mesh", action="append",
                      help="axis=size,... (repeat for several layouts; default: the config's mesh)")
  parser.add_argument("--remat", default="", help="comma-separated remat policies (default: the config's)")
  parser.add_argument("--set", action="append", default=[], help="config overrides, e.g. train.batch=1024")
  parser.add_argument("--out", default=None, help="where to write the table (default experiments/results/"
                                                   "aot_compile[_<stage>].json, only when every layout compiles and fits)")
  args = parser.parse_args()

  config = load_config(args.config, args.set)
  devices = topologies.get_topology_desc(args.topology, "tpu").devices
  layouts = requested_layouts(args.mesh, config)
  remats = [r for r in args.remat.split(",") if r] or [text_section(config).remat_policy]
  program = stage_program(config, devices[0].platform)
  rows, width = program["rows"], program["width"]
  cfg = trainer_lib.text_config(program["model"])
  print(f"{args.config} ({config.stage}) on {args.topology}: {len(devices)} × {devices[0].device_kind}; global batch "
        f"{rows} × {width} = {rows * width:,} tokens; {model_config.param_counts(cfg)['total'] / 1e9:.1f}B "
        f"decoder params; optimizer {config.optimizer.name}", flush=True)
  results = []
  for mesh_sizes in layouts:
    for remat in remats:
      try:
        row = compile_step(config, devices, mesh_sizes, remat)
      except Exception as e:  # pylint: disable=broad-except  (a layout that does not compile is a result)
        row = {"mesh": mesh_sizes, "remat": remat, "error": f"{type(e).__name__}: {e}"}
      results.append(row)
      print(table([row]).splitlines()[-1], flush=True)
  flops = analytic_flops(cfg, rows, width)
  print("\n" + table(results))
  print(f"\nanalytic flops per step: {flops:.3e} ({flops / len(devices) / 1e12:.1f} TFLOP per chip); "
        "collective counts are static (a scanned layer body counts once)")
  result = {"config": args.config, "stage": config.stage, "topology": args.topology, "chips": len(devices),
            "device_kind": devices[0].device_kind, "overrides": args.set, "global_batch": rows,
            "seq_len": width, "analytic_flops_per_step": flops, "layouts": results, "jax": jax.__version__}
  if "media" in program:
    vision_flops = analytic_vision_flops(program["model"].cfg, program["media"])
    print(f"the vision tower and projector over {program['media']:,} patches: {vision_flops:.3e} flops a step "
          f"({vision_flops / flops:.1%} of the decoder's; attention left out)")
    result["analytic_vision_flops_per_step"] = vision_flops
  finish(result, [mesh_name(r["mesh"]) for r in results if "error" in r or r["fits"] is False], args.out,
         default_out(config))


def finish(result: dict, failed: list[str], out: str | None, default: str) -> None:
  """Writes `result` to `out`, or to `default` when nothing `failed`; exits 1 naming what failed."""
  if out or not failed:
    target = out or default
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    with open(target, "w") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {target}")
  if failed:
    print(f"{len(failed)} layout(s) failed to compile or do not fit the chip's HBM: {'; '.join(failed)}"
          + ("" if out else " (nothing written; pass --out to keep this table)"), file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  main()
