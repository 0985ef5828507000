"""Host memory of loading a Hugging Face checkpoint onto devices (issue 40, Must show 2).

A random DeepseekV3-shaped checkpoint (float32, one tensor per routed expert as released) is
loaded by `hf.load(path, shardings)` onto 8 host devices, the routed experts split 8 ways
over `expert` and the rest over `fsdp` (`sharding.logical_to_sharding`), in one process and
in 2 processes × 4 devices (jax.distributed over localhost). Per process it reports what the
load itself holds beyond what the devices end up holding:

    held after   VmRSS after the load − VmRSS before it: the process's device buffers (on
                 host devices they are host memory) and whatever the load kept
    transient    VmHWM during the load − VmRSS after it: the peak the load needed on top
                 (VmHWM reset through /proc/self/clear_refs right before the load)
    bound        the largest slice one device holds of any leaf + the checkpoint's largest
                 tensor: what a load that reads a device's slice at a time may hold at once

and the sum of the addressable shards' bytes (what the devices hold) beside the checkpoint's
size. Linux only (/proc).

    python experiments/bench_hf_load.py [--layers 4] [--hidden 512] [--expert-dim 2048] [--experts 8]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_hf_load.json")
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


def status_bytes(field: str) -> int:
  with open("/proc/self/status") as f:
    return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def write_checkpoint(folder: str, args) -> dict:
  """A random checkpoint of the asked size (k25jax's init, written by `hf.save`)."""
  import jax
  from k25jax.convert import hf
  from k25jax.model import transformer
  from k25jax.model.config import ModelConfig
  cfg = ModelConfig(vocab_size=8192, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                    moe_intermediate_size=args.expert_dim, num_hidden_layers=args.layers, num_attention_heads=4,
                    n_routed_experts=args.experts, num_experts_per_tok=2, q_lora_rank=128, kv_lora_rank=128,
                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=256)
  params = jax.device_get(transformer.init_params(cfg, jax.random.PRNGKey(0)))
  hf.save(cfg, params, folder)
  sizes = [a.nbytes for _, a in hf.to_hf_tensors(cfg, params)]
  return {"checkpoint_bytes": sum(sizes), "largest_tensor_bytes": max(sizes), "tensors": len(sizes)}


def child(args) -> None:
  """One process's load (module docstring); prints its JSON row."""
  if args.num_processes > 1:
    import jax
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id)
  import jax
  from k25jax.convert import hf
  from k25jax.model import transformer
  from k25jax.train import sharding
  cfg = hf.load_config(args.folder)
  mesh = sharding.make_mesh({"fsdp": -1, "expert": 8})
  targets = sharding.logical_to_sharding(transformer.abstract_params(cfg), mesh)
  before = status_bytes("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  _, params = hf.load(args.folder, shardings=targets)
  jax.block_until_ready(params)
  peak, after = status_bytes("VmHWM"), status_bytes("VmRSS")
  held = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
  largest_slice = max(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
  print(json.dumps({"process": args.process_id, "processes": args.num_processes,
                    "devices": jax.local_device_count(), "rss_before": before, "held_after": after - before,
                    "transient": peak - after, "device_bytes": held, "largest_device_slice_bytes": largest_slice}))


def run_processes(n: int, folder: str) -> list[dict]:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // n}")
  procs = [subprocess.Popen([sys.executable, __file__, "--child", "--folder", folder, "--num-processes", str(n),
                             "--process-id", str(i), "--port", str(port)], env=env, cwd=CHECKOUT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
  rows = []
  for p in procs:
    out, err = p.communicate(timeout=900)
    if p.returncode:
      raise RuntimeError(err[-3000:])
    rows.append(json.loads(out.strip().splitlines()[-1]))
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--expert-dim", type=int, default=2048)
  parser.add_argument("--experts", type=int, default=8)
  parser.add_argument("--child", action="store_true")
  parser.add_argument("--folder")
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--port", type=int, default=0)
  args = parser.parse_args()
  if args.child:
    sys.path.insert(0, CHECKOUT)
    child(args)
    return
  sys.path.insert(0, CHECKOUT)
  with tempfile.TemporaryDirectory() as folder:
    checkpoint = write_checkpoint(folder, args)
    rows = run_processes(1, folder) + run_processes(2, folder)
  print(f"checkpoint {checkpoint['checkpoint_bytes'] / MIB:.1f} MiB in {checkpoint['tensors']} tensors, the largest "
        f"{checkpoint['largest_tensor_bytes'] / MIB:.1f} MiB; 8 host devices, experts split 8 ways, the rest over fsdp")
  print(f"{'processes':>9s} {'process':>7s} {'devices':>7s} {'device bytes':>12s} {'held after':>10s} "
        f"{'transient':>9s} {'bound':>7s}   (MiB)")
  for r in rows:
    r["bound"] = r["largest_device_slice_bytes"] + checkpoint["largest_tensor_bytes"]
    print(f"{r['processes']:9d} {r['process']:7d} {r['devices']:7d} {r['device_bytes'] / MIB:12.1f} "
          f"{r['held_after'] / MIB:10.1f} {r['transient'] / MIB:9.1f} {r['bound'] / MIB:7.1f}")
  os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
  with open(RESULTS, "w") as f:
    json.dump({"args": {k: getattr(args, k) for k in ("layers", "hidden", "expert_dim", "experts")},
               "checkpoint": checkpoint, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
