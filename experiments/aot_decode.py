"""Compile the RL sampler's decode step for a TPU pod on this CPU; the latent cache and a decode roofline.

    python experiments/aot_decode.py --config=configs/rl.py:k25 --topology=v5p:8x8x8 \
        --mesh=data=8,expert=64 --shape=2048x32768 --shape=1024x131072

The step is `k25jax.rl.sampler.decode_step` (one new token a row over the MLA latent cache:
the body of the sampler's decode loop), jitted with the params and the cache sharded over
the mesh — params by the logical-axis rules, the cache [rows, context, ·] by rows over the
batch axes (data, fsdp, expert) — the cache donated, under the logical-axis rules (expert
parallelism reads them; `sampler.generate` itself sets none). The decoder runs layer by layer
(the decode path does not scan), without remat, attention on XLA (the einsums over the
cache, split by rows), or with `--attention=pallas` the Pallas decode kernel, each device on
its own rows of the cache (`sequence_parallel.row_split_decode_attention`). For each layout
and shape (rows × context) it prints and writes to experiments/results/aot_decode.json the
per-chip bytes of the compiled step and:

    cache per token   (kv_lora_rank + qk_rope_head_dim) · layers · bytes     576 · 61 · 2 B at k25
    cache per chip    rows / batch shards · context · cache per token
    other bytes       total − cache per chip       (params, temporaries, code: the step's fixed part)
    fits a chip       (HBM − other bytes) / cache per token  cached tokens, e.g. ÷ context = rows

and a roofline ESTIMATE of decode speed (not a measurement): a step reads each chip's params
and its cache once from HBM,

    t_step ≥ (param bytes per chip + cache per chip) / HBM bandwidth          (2.76 TB/s, v5p)
    tokens/s per chip = rows per chip / t_step

leaving out activations, the all-to-alls of expert parallelism, and that a step reads only the
filled part of the cache (a full cache: the bound at its last token). Param bytes per chip
are the arguments less the cache and the token inputs.

Exit status 1 when a shape fails to compile or does not fit the chip's HBM (nothing written
unless `--out`).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aot_compile  # noqa: E402  (experiments/aot_compile.py, beside this script)
from k25jax.model import config as model_config  # noqa: E402
from k25jax.model import attention, transformer  # noqa: E402
from k25jax.rl import sampler  # noqa: E402
from k25jax.train import checkpoint, config_utils, sharding  # noqa: E402

HBM_BANDWIDTH = {"TPU v5": 2.76e12, "TPU v5p": 2.76e12}   # bytes/s per chip
DEFAULT_OUT = os.path.join(aot_compile.RESULTS, "aot_decode.json")
ROOFLINE_CONTEXTS = (4096, 32768, 131072, 262144)


def decode_model_config(section, platform: str, attention_impl: str = "xla") -> model_config.ModelConfig:
  """The policy's decoder as the sampler runs it: layer by layer, no remat; attention on XLA, or
  ("pallas") the latent-cache decode kernel on each device's rows (`sequence_parallel`)."""
  cfg = config_utils.model_config_from(section).replace(scan_layers=False, remat_policy="none",
                                                        attention_impl=attention_impl)
  return aot_compile.target_model_config(cfg, platform)


def cache_bytes_per_token(cfg: model_config.ModelConfig) -> int:
  """The latent and the rope key of every layer, in the compute dtype (what `init_cache` holds)."""
  return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * jnp.dtype(cfg.dtype).itemsize


def row_and_cache_shardings(mesh) -> tuple[NamedSharding, NamedSharding]:
  """Tokens and positions [rows, 1], and each layer's cache [rows, context, width]: rows over the batch axes."""
  return NamedSharding(mesh, P(sharding.BATCH_AXES, None)), NamedSharding(mesh, P(sharding.BATCH_AXES, None, None))


def decode_step(cfg: model_config.ModelConfig, mesh):
  """`sampler.decode_step` jitted with shardings (module docstring), the cache donated."""
  model = transformer.Transformer(cfg)
  params = sharding.logical_to_sharding(transformer.abstract_params(cfg), mesh)
  rows, cache = row_and_cache_shardings(mesh)
  caches = [{"latent": cache, "k_rope": cache}] * cfg.num_hidden_layers

  def step(params, tokens, positions, cache):
    with nn.logical_axis_rules(sharding.RULES):
      return sampler.decode_step(model, params, tokens, positions, cache)

  return jax.jit(step, in_shardings=(params, rows, rows, caches), out_shardings=(rows, caches), donate_argnums=3)


def abstract_inputs(cfg: model_config.ModelConfig, mesh, rows: int, context: int):
  """ShapeDtypeStructs of (params, tokens, positions, cache) with their shardings."""
  boxed = transformer.abstract_params(cfg)
  params = checkpoint.abstract_target(nn.meta.unbox(boxed), sharding.logical_to_sharding(boxed, mesh))
  spec, cache_spec = row_and_cache_shardings(mesh)
  tokens = jax.ShapeDtypeStruct((rows, 1), jnp.int32, sharding=spec)
  cache = [{name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cache_spec) for name, x in layer.items()}
           for layer in jax.eval_shape(lambda: attention.init_cache(cfg, rows, context, jnp.dtype(cfg.dtype)))]
  return params, tokens, tokens, cache


def compile_decode(config, devices, mesh_sizes: dict, rows: int, context: int,
                   compiler_options: dict | None = None, attention_impl: str = "xla") -> dict:
  """Compiles one decode step of `rows` sequences with a cache of `context` tokens; returns the row."""
  cfg = decode_model_config(config.model, devices[0].platform, attention_impl)
  mesh = sharding.make_mesh(mesh_sizes, devices)
  sharding.check_batch(mesh, rows, "--shape rows")
  shards = math.prod(mesh.shape[axis] for axis in sharding.BATCH_AXES)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = decode_step(cfg, mesh).lower(*abstract_inputs(cfg, mesh, rows, context)).compile(compiler_options)
  row = {"mesh": {k: v for k, v in mesh.shape.items() if v > 1}, "rows": rows, "context": context,
         **aot_compile.measure(compiled, devices[0], time.perf_counter() - start),
         "model": aot_compile.model_fields(cfg)}
  per_token = cache_bytes_per_token(cfg)
  rows_per_chip = rows / shards
  cache_chip = rows_per_chip * context * per_token
  token_inputs = 2 * rows_per_chip * jnp.dtype(jnp.int32).itemsize
  row.update(cache_bytes_per_token=per_token, rows_per_chip=rows_per_chip, cache_bytes_per_chip=cache_chip,
             param_bytes_per_chip=row["argument_bytes"] - cache_chip - token_inputs,
             other_bytes_per_chip=row["total_bytes"] - cache_chip)
  if row["hbm_bytes"]:
    row["max_cached_tokens_per_chip"] = int((row["hbm_bytes"] - row["other_bytes_per_chip"]) // per_token)
  bandwidth = HBM_BANDWIDTH.get(devices[0].device_kind)
  if bandwidth and row["hbm_bytes"]:
    row["roofline"] = roofline(row, bandwidth)
  return row


def roofline(row: dict, bandwidth: float) -> list[dict]:
  """The estimate of the module docstring: this shape, then for each of `ROOFLINE_CONTEXTS` the
  most rows a chip holds (its cache filling the HBM the step leaves)."""
  def point(rows_per_chip: float, context: int) -> dict:
    read = row["param_bytes_per_chip"] + rows_per_chip * context * row["cache_bytes_per_token"]
    return {"context": context, "rows_per_chip": rows_per_chip, "bytes_read_per_step": read,
            "step_seconds": read / bandwidth, "tokens_per_s_per_chip": rows_per_chip * bandwidth / read}
  points = [dict(point(row["rows_per_chip"], row["context"]), compiled=True)]
  for context in ROOFLINE_CONTEXTS:
    most = row["max_cached_tokens_per_chip"] // context
    if most:
      points.append(dict(point(most, context), compiled=False))
  return points


def parse_shape(text: str) -> tuple[int, int]:
  """"2048x32768" → (rows, context)."""
  rows, _, context = text.lower().partition("x")
  if not context:
    raise ValueError(f"--shape {text!r}: expected ROWSxCONTEXT, e.g. 2048x32768")
  return int(rows), int(context)


def table(rows: list[dict]) -> str:
  gb = lambda b: f"{b / 1e9:7.1f}"
  lines = [f"{'mesh':22s} {'rows x context':>16s} {'params GB':>9s} {'cache GB':>8s} {'total GB':>8s} "
           f"{'fits':>5s} {'max cached tokens':>17s} {'est. tok/s/chip':>15s} {'compile s':>9s}"]
  for r in rows:
    shape = f"{r['rows']}x{r['context']}"
    if "error" in r:
      lines.append(f"{aot_compile.mesh_name(r['mesh']):22s} {shape:>16s} failed: {r['error'][:120]}")
      continue
    estimate = r["roofline"][0]["tokens_per_s_per_chip"] if "roofline" in r else float("nan")
    lines.append(f"{aot_compile.mesh_name(r['mesh']):22s} {shape:>16s} {gb(r['param_bytes_per_chip']):>9s} "
                 f"{gb(r['cache_bytes_per_chip']):>8s} {gb(r['total_bytes']):>8s} {str(r['fits']):>5s} "
                 f"{r.get('max_cached_tokens_per_chip', 0):>17,d} {estimate:15.0f} {r['compile_seconds']:9.0f}")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/rl.py:k25", help="config file[:preset]; its model section")
  parser.add_argument("--topology", default="v5p:8x8x8", help="TPU topology, e.g. v5p:8x8x8 (512 chips)")
  parser.add_argument("--mesh", action="append", help="axis=size,... (repeat for several layouts; default "
                                                       "data=8,expert=64)")
  parser.add_argument("--shape", action="append", help="ROWSxCONTEXT (repeat; default 2048x32768)")
  parser.add_argument("--set", action="append", default=[], help="config overrides, e.g. model.dtype=bfloat16")
  parser.add_argument("--attention", default="xla", choices=("xla", "pallas"),
                      help="the cache attention: XLA's einsums, or the Pallas decode kernel (Mosaic on the TPU)")
  parser.add_argument("--out", default=None, help=f"where to write the table (default {DEFAULT_OUT}, "
                                                   "only when every shape compiles and fits)")
  args = parser.parse_args()

  config = aot_compile.load_config(args.config, args.set)
  devices = topologies.get_topology_desc(args.topology, "tpu").devices
  layouts = [aot_compile.parse_mesh(m) for m in args.mesh or ["data=8,expert=64"]]
  shapes = [parse_shape(s) for s in args.shape or ["2048x32768"]]
  cfg = decode_model_config(config.model, devices[0].platform, args.attention)
  print(f"{args.config}: decode step on {args.topology} ({len(devices)} × {devices[0].device_kind}); latent cache "
        f"{cache_bytes_per_token(cfg):,} bytes a token ({cfg.kv_lora_rank + cfg.qk_rope_head_dim} numbers × "
        f"{cfg.num_hidden_layers} layers × {jnp.dtype(cfg.dtype).itemsize} B)", flush=True)
  results = []
  for mesh_sizes in layouts:
    for rows, context in shapes:
      try:
        row = compile_decode(config, devices, mesh_sizes, rows, context, attention_impl=args.attention)
      except Exception as e:  # pylint: disable=broad-except  (a shape that does not compile is a result)
        row = {"mesh": mesh_sizes, "rows": rows, "context": context, "error": f"{type(e).__name__}: {e}"}
      results.append(row)
      print(table([row]).splitlines()[-1], flush=True)
  print("\n" + table(results))
  print("\ntok/s/chip is a roofline estimate (params + full cache read once a step at the HBM bandwidth), "
        "not a measurement")
  result = {"config": args.config, "topology": args.topology, "chips": len(devices),
            "device_kind": devices[0].device_kind, "overrides": args.set, "layouts": results,
            "hbm_bandwidth": HBM_BANDWIDTH.get(devices[0].device_kind), "jax": jax.__version__}
  aot_compile.finish(result, [f"{aot_compile.mesh_name(r['mesh'])} {r['rows']}x{r['context']}" for r in results
                              if "error" in r or r["fits"] is False], args.out, DEFAULT_OUT)

if __name__ == "__main__":
  main()
