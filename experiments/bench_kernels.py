"""Benchmark: the Pallas kernels against the best alternative on this backend, same run.

    python experiments/bench_kernels.py [--presets small,k25 --steps 5 --out experiments/results/bench_kernels.json]

Per preset (`k25jax.model.config.preset`) and kernel, the median time of `--steps`
interleaved calls after warm-up, and the achieved rate; the load beside each case is
recorded and nothing is written if any case ran beside other work (`interleave.py`;
`--allow_load` writes it marked):

* routing   ours (fused kernel + sort)   vs the XLA `route` + stable argsort;  GB/s of logits in + scores out
* gmm       ours                         vs megablox gmm (TPU), `jax.lax.ragged_dot`;   TFLOP/s, 2·m·K·N
* tgmm      ours (d_rhs)                 vs megablox tgmm (TPU), d/d_rhs of ragged_dot; TFLOP/s
* attention ours fwd and fwd+bwd         vs `jax.nn.dot_product_attention` (v padded to d_qk),
            splash attention (TPU, v padded), the XLA `causal_attention`;
            causal TFLOP/s: fwd 2·b·h·s(s+1)/2·(d_qk + d_v), fwd+bwd 3× that (no recompute counted)
* decode    ours (latent cache)          vs the XLA core of `MLA.decode`;  GB/s of the cache read

Expert shapes are one expert-parallel shard's: all 64 experts for `small`, 8 of 384
(expert parallelism 48) for `k25`. On CPU the Pallas kernels would run in the
interpreter, whose timings mean nothing: only the XLA paths are timed there, in float32
and at smaller sizes, and the JSON says so. On TPU/GPU the kernels are compiled, bfloat16.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import interleave  # experiments/interleave.py, beside this script
from k25jax.model import attention as model_attention
from k25jax.model import config as model_config
from pallas_kernels import mla_attention, mla_decode, moe

# Problem sizes per preset: (accelerator, CPU).
SIZES = {
    "small": dict(experts_local=64, rows=(8192, 2048), tokens=(16384, 2048), batch=(2, 1), seq=(4096, 512),
                  decode_batch=(8, 4), cache=(32768, 2048)),
    "k25": dict(experts_local=8, rows=(8192, 512), tokens=(16384, 2048), batch=(1, 1), seq=(4096, 512),
                decode_batch=(8, 4), cache=(32768, 2048)),
}


def round_robin(closures: dict, steps: int) -> tuple[dict, float]:
  """Median seconds per closure, timed in interleaved rounds (noise hits all alike; errors kept),
  and the cores other processes used meanwhile (`interleave.LoadMeter`)."""
  ok, results = {}, {}
  for name, fn in closures.items():
    try:
      jax.block_until_ready(fn())                 # compile + warm up
      ok[name] = fn
    except Exception as e:  # noqa: BLE001  (a peer missing on this backend is a row, not a crash)
      results[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
  times, other_cores = interleave.round_robin({name: lambda fn=fn: jax.block_until_ready(fn())
                                               for name, fn in ok.items()}, steps, warmup=0)
  results.update({name: statistics.median(t) for name, t in times.items()})
  return results, other_cores


def _random_groups(rows, n_groups, seed=0):
  sizes = np.bincount(np.random.default_rng(seed).integers(0, n_groups, rows), minlength=n_groups)
  return jnp.asarray(sizes, jnp.int32)


# ------------------------------------------------------------------------------ cases
def case_routing(cfg, sz, compiled, dtype):
  tokens = sz["tokens"][not compiled]
  e = cfg.n_routed_experts
  logits = jax.random.normal(jax.random.PRNGKey(0), (tokens, e), jnp.float32)
  bias = jax.random.normal(jax.random.PRNGKey(1), (e,), jnp.float32) * 0.01
  kw = dict(top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)
  fns = {"xla route + argsort": jax.jit(lambda z: moe.reference_route(z, bias, **kw))}
  if compiled:
    fns["ours"] = jax.jit(lambda z: moe.route(z, bias, **kw))
  return (f"T={tokens} E={e} k={kw['top_k']}", {n: (lambda f=f: f(logits)) for n, f in fns.items()},
          ("GB/s", 2 * tokens * e * 4))


def _gmm_inputs(cfg, sz, compiled, dtype):
  rows, e_local = sz["rows"][not compiled], sz["experts_local"]
  d, f = cfg.hidden_size, cfg.moe_intermediate_size
  lhs = jax.random.normal(jax.random.PRNGKey(0), (rows, d), dtype)
  rhs = (jax.random.normal(jax.random.PRNGKey(1), (e_local, d, f), jnp.float32) * d ** -0.5).astype(dtype)
  return lhs, rhs, _random_groups(rows, e_local), f"m={rows} K={d} N={f} E={e_local}"


def case_gmm(cfg, sz, compiled, dtype):
  lhs, rhs, sizes, shape = _gmm_inputs(cfg, sz, compiled, dtype)
  fns = {"ragged_dot": jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g))}
  if compiled:
    fns["ours"] = jax.jit(lambda x, w, g: moe.gmm(x, w, g))
    if jax.default_backend() == "tpu":
      from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm
      fns["megablox gmm"] = jax.jit(lambda x, w, g: megablox_gmm(x, w, g, preferred_element_type=dtype))
  return shape, {n: (lambda f=f: f(lhs, rhs, sizes)) for n, f in fns.items()}, \
      ("TFLOP/s", 2 * lhs.shape[0] * lhs.shape[1] * rhs.shape[2])


def case_tgmm(cfg, sz, compiled, dtype):
  lhs, rhs, sizes, shape = _gmm_inputs(cfg, sz, compiled, dtype)
  d_out = jax.random.normal(jax.random.PRNGKey(2), (lhs.shape[0], rhs.shape[2]), dtype)
  ragged_vjp = lambda x, w, g, dy: jax.vjp(lambda w: jax.lax.ragged_dot(x, w, g), w)[1](dy)[0]
  fns = {"d/d_rhs ragged_dot": jax.jit(ragged_vjp)}
  if compiled:
    fns["ours"] = jax.jit(lambda x, w, g, dy: moe.tgmm(x, dy, g, w.shape[0]))
    if jax.default_backend() == "tpu":
      from jax.experimental.pallas.ops.tpu.megablox import tgmm as megablox_tgmm
      fns["megablox tgmm"] = jax.jit(lambda x, w, g, dy: megablox_tgmm(x.T, dy, g, preferred_element_type=dtype))
  return shape, {n: (lambda f=f: f(lhs, rhs, sizes, d_out)) for n, f in fns.items()}, \
      ("TFLOP/s", 2 * lhs.shape[0] * lhs.shape[1] * rhs.shape[2])


def _attention_inputs(cfg, sz, compiled, dtype):
  b, s, h = sz["batch"][not compiled], sz["seq"][not compiled], cfg.num_attention_heads
  dqk, dv = cfg.qk_head_dim, cfg.v_head_dim
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k = (jax.random.normal(kk, (b, s, h, dqk), dtype) for kk in keys[:2])
  v = jax.random.normal(keys[2], (b, s, h, dv), dtype)
  flops = 2 * b * h * s * (s + 1) // 2 * (dqk + dv)
  return q, k, v, model_attention.softmax_scale(cfg), f"b={b} s={s} h={h} d_qk={dqk} d_v={dv}", flops


def _attention_impls(scale, compiled, dqk, dv):
  """name → f(q, k, v) -> out [b, s, h, d_v]."""
  pad_v = lambda v: jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dqk - dv)))
  impls = {
      "xla causal_attention": lambda q, k, v: model_attention.causal_attention(q, k, v, scale)[0],
      "dot_product_attention (v padded)": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, pad_v(v), scale=scale, is_causal=True)[..., :dv],
  }
  if jax.default_backend() == "gpu":
    impls["dot_product_attention cudnn (v padded)"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, pad_v(v), scale=scale, is_causal=True, implementation="cudnn")[..., :dv]
  if compiled:
    impls["ours"] = lambda q, k, v: mla_attention.flash_attention(q, k, v, scale)[0]
  if jax.default_backend() == "tpu":
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    def splash_attention(q, k, v):
      b, s, h, _ = q.shape
      mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((s, s)) for _ in range(h)])
      kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1)
      heads_first = lambda x: jnp.swapaxes(x, 1, 2)
      out = jax.vmap(kernel)(heads_first(q * scale), heads_first(k), heads_first(pad_v(v)))
      return jnp.swapaxes(out, 1, 2)[..., :dv]

    impls["splash (v padded)"] = splash_attention
  return impls


def case_attention(cfg, sz, compiled, dtype):
  q, k, v, scale, shape, flops = _attention_inputs(cfg, sz, compiled, dtype)
  impls = _attention_impls(scale, compiled, q.shape[-1], v.shape[-1])
  return shape, {n: (lambda f=jax.jit(f): f(q, k, v)) for n, f in impls.items()}, ("TFLOP/s", flops)


def case_attention_train(cfg, sz, compiled, dtype):
  q, k, v, scale, shape, flops = _attention_inputs(cfg, sz, compiled, dtype)
  impls = _attention_impls(scale, compiled, q.shape[-1], v.shape[-1])
  grad = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
  return shape, {n: (lambda g=grad(f): g(q, k, v)) for n, f in impls.items()}, ("TFLOP/s", 3 * flops)


def case_decode(cfg, sz, compiled, dtype):
  b, cache_len = sz["decode_batch"][not compiled], sz["cache"][not compiled]
  h, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q_lat = jax.random.normal(keys[0], (b, 1, h, c), dtype)
  q_rope = jax.random.normal(keys[1], (b, 1, h, r), dtype)
  latent = jax.random.normal(keys[2], (b, cache_len, c), dtype)
  k_rope = jax.random.normal(keys[3], (b, cache_len, r), dtype)
  positions = jnp.full((b, 1), cache_len - 1, jnp.int32)        # every slot visible: equal reads
  scale = model_attention.softmax_scale(cfg)
  fns = {"xla latent decode": jax.jit(lambda *a: mla_decode.reference(*a, scale))}
  if compiled:
    fns["ours"] = jax.jit(lambda *a: mla_decode.latent_attention(*a, scale))
  args = (q_lat, q_rope, latent, k_rope, positions)
  return f"b={b} S={cache_len} h={h} c={c} r={r}", {n: (lambda f=f: f(*args)) for n, f in fns.items()}, \
      ("GB/s", b * cache_len * (c + r) * jnp.dtype(dtype).itemsize)


CASES = {"routing": case_routing, "gmm": case_gmm, "tgmm (d_rhs)": case_tgmm,
         "attention fwd": case_attention, "attention fwd+bwd": case_attention_train,
         "decode": case_decode}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--presets", default="small,k25")
  parser.add_argument("--kernels", default=",".join(CASES))
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--out", default="experiments/results/bench_kernels.json")
  interleave.add_load_arguments(parser)
  args = parser.parse_args()

  backend = jax.default_backend()
  compiled = backend in ("tpu", "gpu")
  note = ("Pallas kernels compiled (Mosaic on TPU, Triton on GPU), bfloat16" if compiled else
          "CPU: only the XLA paths are timed (float32, reduced sizes); the Pallas kernels run in the "
          "interpreter here, whose timings mean nothing")
  print(f"backend {backend} ({jax.devices()[0].device_kind}), {os.cpu_count()} CPUs; {note}")
  rows, loads = [], []
  for preset in args.presets.split(","):
    cfg = model_config.preset(preset)
    dtype = jnp.dtype(cfg.dtype) if compiled else jnp.float32
    for kernel in args.kernels.split(","):
      shape, closures, (unit, amount) = CASES[kernel](cfg, SIZES[preset], compiled, dtype)
      results, other_cores = round_robin(closures, args.steps)
      loads.append(other_cores)
      ours = results.get("ours")
      for impl, secs in results.items():
        row = dict(preset=preset, kernel=kernel, impl=impl, shape=shape, unit=unit, other_cores=other_cores)
        if isinstance(secs, str):
          row["error"] = secs
        else:
          scale = 1e12 if unit == "TFLOP/s" else 1e9
          row.update(ms=secs * 1e3, rate=amount / secs / scale)
          if isinstance(ours, float):
            row["time_vs_ours"] = secs / ours
        rows.append(row)
        rate = f"{row['rate']:10.4g} {unit:7s}" if "rate" in row else row["error"]
        ms = f"{row['ms']:10.2f}" if "ms" in row else " " * 10
        ratio = f"{row['time_vs_ours']:6.2f}x" if "time_vs_ours" in row else "      -"
        print(f"{preset:6s} {kernel:18s} {impl:40s} {shape:34s} {ms} ms {rate} {ratio}", flush=True)

  loaded = interleave.refuse_if_loaded(loads, args.max_load, args.allow_load)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(backend=backend, device=jax.devices()[0].device_kind, cpus=os.cpu_count(), note=note,
                   steps=args.steps, jax=jax.__version__, loaded=loaded, max_load=args.max_load, time_vs_ours="peer time / our time (>1: ours faster)",
                   rows=rows), f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
