"""Every kernel lowers for TPU (Pallas → Mosaic) and GPU (Pallas → Triton), from CPU.

`jax.export` lowers for a platform without its hardware, which runs Pallas's own
lowering (block shapes, memory spaces, the primitives used in the kernels, Triton's
power-of-two sizes). Compiling the lowered kernels still needs the accelerator.
"""
import jax
import jax.numpy as jnp
import pytest
from jax import export

from pallas_kernels import common, mla_attention, mla_decode, moe

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _loss(fn):
  return lambda *a: jnp.sum(fn(*a).astype(jnp.float32))


KERNELS = {   # name → () → (a fresh function, so no trace is shared between platforms; abstract arguments)
    "attention_fwd_bwd": lambda: (
        jax.grad(_loss(lambda q, k, v, seg: mla_attention.flash_attention(q, k, v, 0.1, seg)[0]), argnums=(0, 1, 2)),
        (S((1, 256, 2, 96), BF16), S((1, 256, 2, 96), BF16), S((1, 256, 2, 64), BF16), S((1, 256), jnp.int32))),
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
