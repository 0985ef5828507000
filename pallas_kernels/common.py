"""What every kernel needs: which backend it runs on, and the padding that backend asks for.

A kernel here is lowered one of three ways, named by `target(interpret)`:

* ``"tpu"``        compiled with Mosaic (block shapes (8·i, 128·j) or full, scalar
                   prefetch into SMEM, VMEM scratch carried across a sequential grid axis);
* ``"gpu"``        compiled with Triton (no scalar prefetch, no scratch; every array a
                   kernel loads or stores must have a power-of-two size);
* ``"interpret"``  the Pallas HLO interpreter, on any backend (CPU in the tests). It runs
                   the TPU formulation unless a kernel is asked for its GPU one.

`interpret=None` means: compile on TPU/GPU, interpret elsewhere. "The backend" is the
platform of the devices the program is traced for: the current mesh's (`jax.set_mesh`, so
a CPU host compiling ahead of time for a TPU mesh gets Mosaic kernels), else the default
backend's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

COMPILED = ("tpu", "gpu")


def platform() -> str:
  """The platform of the current mesh's devices ("tpu", "gpu", "cpu"), else the default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.abstract_device is not None:
    return "gpu" if mesh.abstract_device.platform in ("cuda", "rocm") else mesh.abstract_device.platform
  return jax.default_backend()


def target(interpret: bool | None = None) -> str:
  """"tpu" | "gpu" | "interpret" for `platform()`."""
  backend = platform()
  if interpret or (interpret is None and backend not in COMPILED):
    return "interpret"
  if backend not in COMPILED:
    raise ValueError(f"compiled Pallas needs a TPU or GPU backend, this one is {backend!r}; "
                     "pass interpret=True (or None) to run the kernels in the interpreter")
  return backend


def compiler_params(where: str, semantics: tuple[str, ...]):
  """Mosaic grid-axis semantics ("parallel" | "arbitrary") on TPU; Triton on GPU.

  On GPU `pallas_call` picks Mosaic GPU unless given Triton's CompilerParams; these
  kernels are written for Triton (Hopper-only Mosaic GPU wants warpgroup kernels).
  """
  if where == "tpu":
    return pltpu.CompilerParams(dimension_semantics=semantics)
  if where == "gpu":
    return pltriton.CompilerParams()
  return None


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def next_pow2(n: int, minimum: int = 1) -> int:
  """Smallest power of two ≥ max(n, minimum)."""
  p = 1
  while p < max(n, minimum):
    p *= 2
  return p


def pad_to(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  """x zero- (or `value`-) padded along `axis` up to `size` (a no-op when already that long)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def divisor_block(dim: int, preferred: int) -> int:
  """Largest power of two ≤ `preferred` dividing `dim` (`dim` itself if none ≥ 8 does)."""
  block = next_pow2(preferred)
  while block > preferred:
    block //= 2
  while block >= 8:
    if dim % block == 0:
      return min(block, dim)
    block //= 2
  return dim


def neg_inf(dtype=jnp.float32):
  return jnp.array(-jnp.inf, dtype)
