"""The device mesh, the one table of logical-axis rules, and the Partitioner that jits.

Parameters name their logical axes where they are created (`nn.with_logical_partitioning`
in `t5x_lite.nn.layers`) and activations are constrained at block boundaries with
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

`Partitioner` (T5X's `PjitPartitioner`) carries the mesh and the rules together and
is the one place that jits model code with shardings: train and eval steps
(`t5x_lite.training.trainer`), predict and score (`t5x_lite.run.model_runner`) and the
ahead-of-time compile (`t5x_lite.run.precompile`, which lowers the very function
training runs). Gin: `Partitioner.num_partitions`, `Partitioner.fsdp`, the same
for train, eval and infer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import gin
import jax
from flax.core import meta
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_lite.core.errors import ConfigError
from t5x_lite.core.types import Device
from t5x_lite.nn import layers

LogicalRules = tuple[tuple[str, str | None], ...]
MESH_AXES = ('data', 'model')


def create_mesh(
  num_partitions: int = 1,
  data: int | None = None,
  model: int | None = None,
  devices: Sequence[Device] | None = None,
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
    assert spec is not None  # None only for names=None, which a Partitioned leaf never has
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


class PartitionedFunction:
  """A jitted function that runs and lowers under its partitioner's mesh and rules."""

  def __init__(self, jitted: jax.stages.Wrapped, partitioner: Partitioner):
    self.jitted = jitted
    self._partitioner = partitioner

  def __call__(self, *args: Any) -> Any:
    with self._partitioner.context():
      return self.jitted(*args)

  def lower(self, *args: Any) -> jax.stages.Lowered:
    """Lowers for `args` (arrays or `jax.ShapeDtypeStruct`s carrying shardings)."""
    with self._partitioner.context():
      return self.jitted.lower(*args)


@gin.configurable
class Partitioner:
  """The ('data', 'model') mesh, its logical-axis rules, and jit with their shardings.

  Attributes:
    mesh: the device mesh.
    rules: the logical-axis rules (`standard_logical_axis_rules(fsdp)`).
  """

  def __init__(
    self,
    num_partitions: int = 1,
    fsdp: bool = False,
    *,
    devices: Sequence[Device] | None = None,
  ):
    """Builds the mesh over `devices`.

    Args:
      num_partitions: model-parallel size; the data axis takes the other devices.
      fsdp: also shard parameters' 'embed' axis over 'data'.
      devices: default all devices (compile-only devices for `t5x_lite.run.precompile`).

    Raises:
      ConfigError: if `num_partitions` does not divide the number of devices.
    """
    count = len(jax.devices() if devices is None else devices)
    if num_partitions < 1 or count % num_partitions:
      raise ConfigError(
        f"Partitioner.num_partitions={num_partitions}: a mesh with model={num_partitions} "
        f"does not match {count} devices; choose a divisor of {count}."
      )
    self.mesh = create_mesh(num_partitions=num_partitions, devices=devices)
    self.rules = standard_logical_axis_rules(fsdp=fsdp)

  @contextlib.contextmanager
  def context(self) -> Iterator[None]:
    """Mesh and rules in scope, so `nn.with_logical_constraint` resolves against them."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield

  @property
  def data_size(self) -> int:
    """Devices along the 'data' axis (global batches must divide by it)."""
    return self.mesh.shape['data']

  @property
  def batch_sharding(self) -> NamedSharding:
    """Sharding of [batch, length] inputs: batch over 'data'."""
    return batch_sharding(self.mesh)

  @property
  def replicated(self) -> NamedSharding:
    """A fully replicated sharding (scalars, RNG keys, metrics)."""
    return NamedSharding(self.mesh, PartitionSpec())

  def logical_shardings(self, tree: Any) -> Any:
    """`logical_shardings(tree)` on this mesh with these rules."""
    return logical_shardings(tree, self.mesh, self.rules)

  def abstract_params(self, init_params: Callable[[jax.Array], Any]) -> tuple[Any, Any]:
    """Shapes and shardings of parameters, nothing allocated and no PRNG key made.

    Args:
      init_params: rng -> boxed parameter tree (e.g. a model's `init_params` or
        `init_aux_state`, `t5x_lite.base_model.BaseModel`); traced with an abstract key
        only, so it works on compile-only devices.

    Returns:
      (plain tree of `jax.ShapeDtypeStruct` carrying their shardings: a restore target
      for checkpoints; the tree of NamedSharding).
    """
    with self.context():
      boxed = layers.abstract_boxed_params(init_params)
    shardings = self.logical_shardings(boxed)
    abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      nn.meta.unbox(boxed),
      shardings,
    )
    return abstract, shardings

  def jit(
    self,
    fn: Callable[..., Any],
    in_shardings: Any,
    out_shardings: Any,
    donate_argnums: Sequence[int] = (),
  ) -> PartitionedFunction:
    """`jax.jit` with explicit shardings; calls and lowerings enter `context()`."""
    jitted = jax.jit(
      fn,
      in_shardings=in_shardings,
      out_shardings=out_shardings,
      donate_argnums=tuple(donate_argnums),
    )
    return PartitionedFunction(jitted, self)
