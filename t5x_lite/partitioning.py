"""Device mesh and the one table of logical-axis rules.

Parameters name their logical axes where they are created (`nn.with_logical_partitioning`
in `t5x_lite.layers`) and activations are constrained at block boundaries with
`nn.with_logical_constraint`. This module holds the only mapping from those logical
names to the two mesh axes:

* 'data': data parallelism. The batch axis of activations and inputs is split over
  it. With `fsdp=True` the parameters' 'embed' axis is split over it as well
  (fully sharded data parallelism / ZeRO-3 style: every device holds 1/data of each
  kernel, gathered on use), which cuts parameter and optimizer memory.
* 'model': tensor (model) parallelism, Megatron style: 'vocab', 'heads' and 'mlp'
  are split over it, so attention heads, feed-forward hidden units and the
  embedding / logits vocabulary are divided between devices.

Everything else ('kv', 'length', 'relpos_buckets', 'layers') is replicated.
Rules are ordered: a logical axis takes its mesh axis only if no earlier-listed
dimension of the same array already took it, so activations
('batch', 'length', 'embed') keep 'data' on the batch even with fsdp.
"""

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from flax.core import meta
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalRules = tuple[tuple[str, str | None], ...]
MESH_AXES = ('data', 'model')


def create_mesh(
  num_partitions: int = 1,
  data: int | None = None,
  model: int | None = None,
  devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """Builds a ('data', 'model') mesh over `devices` (default: all devices).

  Args:
    num_partitions: model-parallel size, used when `model` is not given.
    data: data-parallel size; default len(devices) // model.
    model: model-parallel size; overrides num_partitions.
    devices: the devices to use.

  Returns:
    A `jax.sharding.Mesh` with axis names ('data', 'model') and Auto axis types
    (sharding propagated by the compiler from the constraints we give it).

  Raises:
    ValueError: if data * model differs from the number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  model = num_partitions if model is None else model
  data = len(devices) // model if data is None else data
  if data * model != len(devices) or data < 1:
    raise ValueError(f'mesh data={data} x model={model} does not match {len(devices)} devices')
  device_grid = mesh_utils.create_device_mesh(
    (data, model), devices, allow_split_physical_axes=True
  )
  return Mesh(device_grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def standard_logical_axis_rules(fsdp: bool = False) -> LogicalRules:
  """The logical-name -> mesh-axis table (see the module docstring).

  Args:
    fsdp: also shard parameters' 'embed' axis over 'data'.

  Returns:
    Ordered (logical_name, mesh_axis or None) pairs for `nn.logical_axis_rules`
    and `logical_shardings`.
  """
  return (
    ('batch', 'data'),
    ('vocab', 'model'),
    ('heads', 'model'),
    ('mlp', 'model'),
    ('embed', 'data' if fsdp else None),
    ('kv', None),
    ('length', None),
    ('relpos_buckets', None),
    ('layers', None),
  )


def _leaf_sharding(leaf: Any, mesh: Mesh, rules: LogicalRules) -> NamedSharding:
  """NamedSharding of one leaf: from its logical names if boxed, else replicated."""
  if isinstance(leaf, meta.Partitioned):
    spec = nn.logical_to_mesh_axes(leaf.names, rules)
    return NamedSharding(mesh, spec)
  return NamedSharding(mesh, PartitionSpec())


def logical_shardings(tree: Any, mesh: Mesh, rules: LogicalRules) -> Any:
  """Maps a tree to NamedShardings by the logical axes of its boxed leaves.

  Works on boxed parameter trees, abstract trees from `jax.eval_shape` (boxes around
  ShapeDtypeStructs), and optimizer-state-like trees whose leaves are boxes or
  plain arrays/scalars. Each `LogicallyPartitioned` box becomes one NamedSharding
  leaf (a pytree prefix of the box, as `jax.jit` in/out_shardings accept); any
  other leaf (unboxed array, step counter, scalar) is replicated.

  Args:
    tree: the pytree to shard.
    mesh: the device mesh.
    rules: logical-axis rules, e.g. `standard_logical_axis_rules()`.

  Returns:
    A tree of `jax.sharding.NamedSharding` with the structure of `tree` where
    every box is a leaf.
  """
  return jax.tree.map(
    lambda leaf: _leaf_sharding(leaf, mesh, rules),
    tree,
    is_leaf=lambda x: isinstance(x, meta.Partitioned),
  )


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding for [batch, length] input arrays: batch over 'data', length replicated."""
  return NamedSharding(mesh, PartitionSpec('data', None))
