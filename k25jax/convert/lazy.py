"""Param leaves read from a checkpoint a slice at a time.

    Tensor(shape, read)   one checkpoint tensor as k25jax wants it (dequantized, not yet
                          transposed); `read()` reads it from the file
    Leaf(shape, read)     a param leaf; `read(index)` the values at `index` (a tuple of
                          slices, as `jax.make_array_from_callback` gives each device)

    single(t, f)          a leaf that is f(one tensor), read once and kept while the leaf's
                          slices are placed
    experts(ts, f)        a stacked expert leaf [E, ...]: a read of experts a..b reads those
                          tensors only, one at a time
    stacked(leaves)       a scanned leaf [L, ...] of per-layer leaves, read per layer
    materialize(leaf, dtype, sharding)
                          the jax.Array: each addressable device's slice read, converted and
                          put on its device before the next one is read

So a process holds at most one device's slice of a leaf plus the checkpoint tensor being
read (the largest tensor bounds it), never a whole stacked leaf, and reads only the experts
its devices hold; a tensor whose leaf several devices slice is read (and dequantized) once.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Index = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class Tensor:
  shape: tuple[int, ...]
  read: Callable[[], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Leaf:
  shape: tuple[int, ...]
  read: Callable[[Index], np.ndarray]
  release: Callable[[], None] = lambda: None   # drops what `read` kept for the leaf's other slices


def whole(shape: Sequence[int]) -> Index:
  return tuple(slice(None) for _ in shape)


def single(shape: tuple[int, ...], tensor: Tensor, transform: Callable[[np.ndarray], np.ndarray]) -> Leaf:
  """A leaf of `shape` that is transform(tensor): the tensor is read (and dequantized) once
  and kept until `release`, so the devices' slices of one leaf share the read."""
  kept: dict[str, np.ndarray] = {}

  def read(index: Index) -> np.ndarray:
    if "value" not in kept:
      kept["value"] = transform(tensor.read())
    return kept["value"][index]
  return Leaf(tuple(shape), read, kept.clear)


def experts(shape: tuple[int, ...], tensors: Sequence[Tensor], transform: Callable[[np.ndarray], np.ndarray]
            ) -> Leaf:
  """A stacked leaf [E, ...] whose row e is transform(tensors[e])."""
  def read(index: Index) -> np.ndarray:
    rows = range(shape[0])[index[0]]
    out = np.empty((len(rows),) + _sliced(shape[1:], index[1:]), np.float32)
    for j, e in enumerate(rows):
      out[j] = transform(tensors[e].read())[index[1:]]
    return out
  return Leaf(tuple(shape), read)


def stacked(*leaves: Leaf) -> Leaf:
  """The leaves stacked on a new leading axis (the scanned layout's layer axis)."""
  inner = leaves[0].shape
  return Leaf((len(leaves),) + inner, lambda index: np.stack([leaves[i].read(index[1:])
                                                              for i in range(len(leaves))[index[0]]]))


def _sliced(shape: Sequence[int], index: Index) -> tuple[int, ...]:
  return tuple(len(range(n)[s]) for n, s in zip(shape, index)) + tuple(shape[len(index):])


def _key(index: Index) -> tuple:
  return tuple((s.start, s.stop, s.step) for s in index)


def materialize(leaf: Leaf, dtype, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
  """The leaf as a jax.Array of `dtype`: on `sharding`, each addressable device's slice read,
  converted and put on its device before the next is read (a slice another device already
  holds is copied from it); without one, read whole onto the default device."""
  convert = lambda index: np.asarray(leaf.read(index), dtype=dtype)
  if sharding is None:
    return jnp.asarray(convert(whole(leaf.shape)))
  placed, shards = {}, []
  for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
    index = tuple(index) + whole(leaf.shape)[len(index):]
    key = _key(index)
    shards.append(jax.device_put(placed[key] if key in placed else convert(index), device))
    placed.setdefault(key, shards[-1])
  leaf.release()
  return jax.make_array_from_single_device_arrays(leaf.shape, sharding, shards)
