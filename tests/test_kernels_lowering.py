"""Every kernel lowers for TPU (Pallas → Mosaic) and GPU (Pallas → Triton), from CPU.

`jax.export` lowers for a platform without its hardware, which runs Pallas's own
lowering (block shapes, memory spaces, the primitives used in the kernels, Triton's
power-of-two sizes). Compiling the lowered kernels still needs the accelerator, except
for TPU where libtpu is installed: it compiles for a chip it describes, without one.
"""
import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.sharding import SingleDeviceSharding

from pallas_kernels import common, mla_attention, mla_decode, moe, vision_attention

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _loss(fn):
  return lambda *a: jnp.sum(fn(*a).astype(jnp.float32))


def _attention_grad():
  return jax.grad(_loss(lambda q, k, v, seg: mla_attention.flash_attention(q, k, v, 0.1, seg)[0]),
                  argnums=(0, 1, 2))


def _attention_args(seq, heads, dqk, dv, **sharding):
  """Abstract q, k, v [1, seq, heads, ·] (bf16) and segment ids [1, seq]."""
  qkv = [S((1, seq, heads, d), BF16, **sharding) for d in (dqk, dqk, dv)]
  return qkv + [S((1, seq), jnp.int32, **sharding)]


def _vision_grad():
  return jax.grad(_loss(lambda q, k, v, seg: vision_attention.flash_attention(q, k, v, seg)), argnums=(0, 1, 2))


def _vision_args(patches, **sharding):
  """Abstract q, k, v [patches, 16, 72] (bf16, K2.5's vision heads) and segment ids [patches]."""
  return [S((patches, 16, 72), BF16, **sharding) for _ in range(3)] + [S((patches,), jnp.int32, **sharding)]


KERNELS = {   # name → () → (a fresh function, so no trace is shared between platforms; abstract arguments)
    "attention_fwd_bwd": lambda: (_attention_grad(), _attention_args(256, 2, 96, 64)),
    # K2.5 head dims at 32K; on TPU, K/V tiled in blocks of 512 keys
    "attention_fwd_bwd_32k": lambda: (_attention_grad(), _attention_args(32768, 1, 192, 128)),
    # the largest image MoonViT-3D takes, 16,384 patches, at K2.5's vision dims
    "vision_attention_fwd_bwd_16k": lambda: (_vision_grad(), _vision_args(16384)),
    "decode": lambda: (
        lambda *a: mla_decode.latent_attention(*a, 0.1),
        (S((2, 1, 16, 256), BF16), S((2, 1, 16, 32), BF16), S((2, 1024, 256), BF16), S((2, 1024, 32), BF16),
         S((2, 1), jnp.int32))),
    "route_grouped": lambda: (
        lambda z, b: moe.route(z, b, top_k=6, n_group=8, topk_group=4),
        (S((512, 64), jnp.float32), S((64,), jnp.float32))),
    "sort": lambda: (lambda e: moe.sort_by_expert(e, 64), (S((512, 6), jnp.int32),)),
    "gmm_fwd_bwd_shard": lambda: (
        jax.grad(_loss(lambda x, w, g: moe.gmm(x, w, g, 8)), argnums=(0, 1)),
        (S((1024, 1024), BF16), S((8, 1024, 256), BF16), S((64,), jnp.int32))),
}
PLATFORMS = {"tpu": "tpu", "gpu": "cuda"}


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_lowers(kernel, platform, monkeypatch):
  monkeypatch.setattr(common, "target", lambda interpret=None: platform)
  fn, args = KERNELS[kernel]()
  unstable_ok = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  exported = export.export(jax.jit(fn), platforms=[PLATFORMS[platform]], disabled_checks=unstable_ok)(*args)
  custom_call = "tpu_custom_call" if platform == "tpu" else "xla.gpu.triton"
  assert custom_call in exported.mlir_module()


NEEDS_LIBTPU = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu]'): the TPU compiler, "
                                         "no TPU needed")


def _compile_for_v5p(fn, args, monkeypatch):
  """`fn` compiled for one v5p chip (libtpu, no TPU); `args(sharding=)` its abstract arguments."""
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")      # other test processes may hold libtpu's lock
  monkeypatch.setattr(common, "target", lambda interpret=None: "tpu")
  from jax.experimental import topologies
  chip = SingleDeviceSharding(topologies.get_topology_desc("v5p:2x2x1", "tpu").devices[0])
  with jax.default_matmul_precision("default"):   # conftest's "highest" asks Mosaic for fp32 matmuls of bf16
    return jax.jit(fn).lower(*args(sharding=chip)).compile()


@NEEDS_LIBTPU
def test_attention_compiles_for_a_v5p_chip_at_262k_tokens(monkeypatch):
  """K2.5 head dims at the full 262,144-token context: the tiled kernels fit the chip's scoped VMEM
  (whole K/V rows per program, as before tiling, ran out of it already at 32K)."""
  compiled = _compile_for_v5p(_attention_grad(), lambda **s: _attention_args(262144, 1, 192, 128, **s), monkeypatch)
  assert compiled.memory_analysis().temp_size_in_bytes > 0


@NEEDS_LIBTPU
def test_vision_attention_compiles_for_a_v5p_chip_at_16k_patches(monkeypatch):
  """16,384 patches, 16 heads of 72: the kernels fit the chip's scoped VMEM, and forward + backward
  take under 1/16 of the 16 GiB that the XLA path's [heads, N, N] float32 logits alone need."""
  patches, heads = 16384, 16
  compiled = _compile_for_v5p(_vision_grad(), lambda **s: _vision_args(patches, **s), monkeypatch)
  assert compiled.memory_analysis().temp_size_in_bytes < heads * patches * patches * 4 // 16
