"""The device mesh, the logical-axis rules, and shardings of params, state and batches.

Mesh axes (outermost first): `data` (pure data parallel), `fsdp` (data parallel with
params and optimizer state sharded), `expert` (routed experts split across devices,
the batch too), `sequence` (activations split along the sequence) and `tensor`
(heads, MLP and vocab split; innermost, so it gets the fastest links).

Every param and activation carries logical axis names (`nn.with_logical_partitioning`,
`nn.with_logical_constraint`); `RULES` is the one table mapping them to mesh axes.
A logical axis listed twice takes the first mesh axis that is still free in that array.
The decoder's params are split over `sequence` as over `fsdp` (gathered where they are
used), so a long-context layout does not hold a copy of them per sequence shard.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "expert", "sequence", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")
DEVICES = "devices"   # the mesh section's device count beside its axes: -1 (all) or the first N

RULES = (
    # ---- params
    ("vocab", "tensor"),
    ("embed", ("fsdp", "sequence")),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("qk_head_dim", None),
    ("kv_head_dim", None),
    ("q_lora", ("fsdp", "sequence")),   # q_b / kv_b split on their input (embed is not one of their axes)
    ("kv_lora", ("fsdp", "sequence")),
    ("exp", "expert"),
    ("moe_mlp", "tensor"),
    ("norm", None),
    ("layers", None),            # the stacked axis of the scanned MoE layers
    # MoonViT-3D and the projector
    ("vit_embed", "fsdp"),
    ("vit_heads", "tensor"),
    ("vit_mlp", "tensor"),
    ("vit_head_dim", None),
    ("vit_qkv", None),
    ("vit_patch", None),
    ("vit_pos", None),
    ("vit_norm", None),
    ("mm_in", "fsdp"),
    ("mm_hidden", "tensor"),
    # ---- activations
    ("activation_batch", BATCH_AXES),
    ("activation_length", "sequence"),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
)


def mesh_shape(sizes: dict[str, int], n_devices: int) -> tuple[int, ...]:
  """Axis sizes in `AXES` order over `n_devices`, or over the first `sizes["devices"]` of them
  when the section names a count (`DEVICES`; -1 or absent: all); one size of -1 takes the
  devices the others leave."""
  sizes = dict(sizes)
  wanted = int(sizes.pop(DEVICES, -1))
  unknown = set(sizes) - set(AXES)
  if unknown:
    raise ValueError(f"mesh: unknown axes {sorted(unknown)}; the axes are {AXES} (and {DEVICES!r}, a count)")
  if wanted != -1 and not 1 <= wanted <= n_devices:
    raise ValueError(f"mesh.{DEVICES}={wanted}: must be -1 (all) or between 1 and the {n_devices} devices")
  n_devices = n_devices if wanted == -1 else wanted
  shape = [int(sizes.get(name, 1)) for name in AXES]
  free = [i for i, s in enumerate(shape) if s == -1]
  if len(free) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh {dict(zip(AXES, shape))}: sizes must be positive, at most one -1")
  fixed = math.prod(s for s in shape if s != -1)
  if free:
    if n_devices % fixed:
      raise ValueError(f"mesh {dict(zip(AXES, shape))}: the fixed axes ({fixed} devices) do not "
                       f"divide the {n_devices} devices")
    shape[free[0]] = n_devices // fixed
  elif fixed != n_devices:
    raise ValueError(f"mesh {dict(zip(AXES, shape))} needs {fixed} devices, "
                     f"but {n_devices} are available")
  return tuple(shape)


def make_mesh(sizes: dict[str, int], devices=None) -> jax.sharding.Mesh:
  """A mesh with Auto axes `AXES` over `devices` (default: all devices, all processes), or over
  the first `sizes["devices"]` of them (one process only: a smaller mesh for a run that does
  not need them all, e.g. a numerics test on a CPU's forced host devices).

  On a TPU torus each mesh axis should be a product of whole physical axes (a v5p 8x8x8:
  8, 64, 512); a size that is not (16 or 32 there) splits a physical axis, with a warning,
  since collectives along it then share links with another mesh axis.
  """
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(sizes, len(devices))
  if math.prod(shape) < len(devices):
    if jax.process_count() > 1:
      raise ValueError(f"mesh.{DEVICES}={sizes[DEVICES]}: a run of {jax.process_count()} processes "
                       "uses every device (-1)")
    devices = devices[:math.prod(shape)]
  axis_types = (jax.sharding.AxisType.Auto,) * len(AXES)
  try:
    return jax.make_mesh(shape, AXES, axis_types=axis_types, devices=devices)
  except NotImplementedError as e:   # no assignment of whole physical axes
    logging.warning("mesh %s: splitting physical axes (%s)", dict(zip(AXES, shape)), str(e).split(".")[0])
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return jax.sharding.Mesh(grid, AXES, axis_types=axis_types)


def is_spec(x) -> bool:
  return isinstance(x, P)


def mesh_specs(boxed_tree):
  """Mesh PartitionSpecs for every array leaf of a tree with `nn.LogicallyPartitioned` boxes.

  The result has the structure of the UNBOXED tree: a box's spec is repeated over the
  leaves of its value (none for the `optax.MaskedNode` of a masked-out param); leaves
  outside boxes (counters, rng) are replicated.
  """
  def spec(x):
    if isinstance(x, nn.LogicallyPartitioned):
      mesh_axes = nn.logical_to_mesh_axes(x.names, RULES)
      return jax.tree.map(lambda _: mesh_axes, x.value)
    return P()
  return jax.tree.map(spec, boxed_tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def logical_to_sharding(boxed_tree, mesh: jax.sharding.Mesh):
  """NamedShardings over `mesh` of every array leaf (unboxed structure, see `mesh_specs`)."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), mesh_specs(boxed_tree), is_leaf=is_spec)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """[batch, seq] arrays: batch over data/fsdp/expert, sequence over `sequence`."""
  return NamedSharding(mesh, P(BATCH_AXES, "sequence"))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
  """Global arrays from this process's rows (all rows when there is one process)."""
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)


def from_host(tree, sharding: NamedSharding):
  """Global arrays laid out by `sharding` from host arrays that every process holds whole
  (the same values everywhere); each process puts only its own devices' slices."""
  return jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), sharding,
                                                             lambda index, x=np.asarray(x): x[index]), tree)


def batch_shards(mesh: jax.sharding.Mesh) -> int:
  """The groups of rows a batch splits into: the product of the mesh's batch axes."""
  return int(np.prod([mesh.shape[axis] for axis in BATCH_AXES]))


def check_batch(mesh: jax.sharding.Mesh, rows: int, field: str) -> None:
  """A config error, naming `field`, unless `rows` split evenly over the mesh's batch axes
  (data x fsdp x expert) and over the processes."""
  shards = batch_shards(mesh)
  for divisor, what in ((shards, "batch shards of the mesh (data x fsdp x expert)"),
                        (jax.process_count(), "processes")):
    if rows % divisor:
      raise ValueError(f"{field}={rows} must divide evenly over the {divisor} {what}")
