"""Scanned and unscanned parameter layouts, and exact conversions between them.

With `T5Config.scan_layers` a stack's layers are one `nn.scan`ned module: its params
sit under `encoder/layers/...` / `decoder/layers/...`, stacked on a new leading axis
(layer i at index i). Unscanned, they are `encoder/layers_0/...`, `layers_1/...`.
`checkpoint_view` shows a checkpoint's stored paths and shapes as a model of the other
layout sees them: each parameter of the view is a `Read` of stored leaves (one index of
a stacked leaf, or the layers' leaves stacked). `assemble` builds the model's parameter
from the restored leaves with jitted slices / stacks whose outputs have the model's
shardings; `read_sharding` is the sharding a stored leaf is best restored with. Only
slices and stacks are involved, so conversions are exact (a round trip is bitwise).
Used by `t5x_lite.checkpoint.partial_restore`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

Shape = tuple[int, ...]

_STACKED = re.compile(r"(?P<stack>[^/]+)/layers/(?P<rest>.+)")
_LAYER = re.compile(r"(?P<stack>[^/]+)/layers_(?P<index>\d+)/(?P<rest>.+)")


def layout(paths: Iterable[str]) -> str | None:
  """'scanned' (`<stack>/layers/...`), 'unscanned' (`<stack>/layers_<i>/...`) or None.

  None: no layers, or both kinds.
  """
  paths = list(paths)
  scanned = any(_STACKED.fullmatch(p) for p in paths)
  unscanned = any(_LAYER.fullmatch(p) for p in paths)
  if scanned == unscanned:
    return None
  return "scanned" if scanned else "unscanned"


@dataclasses.dataclass(frozen=True)
class Read:
  """One parameter of the checkpoint as the model's layout sees it.

  Attributes:
    sources: the stored paths it is made of.
    shape: its shape in the model's layout.
    index: take this index of the one stacked source's leading axis.
    stacked: stack the sources (one per layer) on a new leading axis.
  """

  sources: tuple[str, ...]
  shape: Shape
  index: int | None = None
  stacked: bool = False


def _unstacked(saved: Mapping[str, Shape]) -> dict[str, Read]:
  """The view of a scanned checkpoint from an unscanned model: layer i = index i."""
  view = {}
  for path, shape in saved.items():
    if (match := _STACKED.fullmatch(path)) and shape:
      for i in range(shape[0]):
        name = f"{match['stack']}/layers_{i}/{match['rest']}"
        view[name] = Read((path,), tuple(shape[1:]), index=i)
    else:
      view[path] = Read((path,), tuple(shape))
  return view


def _stacked(saved: Mapping[str, Shape]) -> dict[str, Read]:
  """The view of an unscanned checkpoint from a scanned model: layers stacked on axis 0."""
  view = {}
  groups: dict[tuple[str, str], dict[int, str]] = collections.defaultdict(dict)
  for path, shape in saved.items():
    if match := _LAYER.fullmatch(path):
      groups[match["stack"], match["rest"]][int(match["index"])] = path
    else:
      view[path] = Read((path,), tuple(shape))
  for (stack, rest), by_index in groups.items():
    paths = tuple(by_index[i] for i in sorted(by_index))
    shapes = {tuple(saved[p]) for p in paths}
    if sorted(by_index) != list(range(len(paths))) or len(shapes) != 1:
      view.update({p: Read((p,), tuple(saved[p])) for p in paths})  # not one stack: as stored
      continue
    view[f"{stack}/layers/{rest}"] = Read(paths, (len(paths), *shapes.pop()), stacked=True)
  return view


def checkpoint_view(saved: Mapping[str, Shape], model_layout: str | None) -> dict[str, Read]:
  """The stored parameters (path -> shape) as a model of `model_layout` sees them."""
  stored = layout(saved)
  if model_layout is None or stored is None or stored == model_layout:
    return {path: Read((path,), tuple(shape)) for path, shape in saved.items()}
  return _stacked(saved) if model_layout == "scanned" else _unstacked(saved)


# ----------------------------------------------------------------------------
# Reading: slices, stacks and casts into the model's shardings.


def read_sharding(sharding: jax.sharding.Sharding, read: Read) -> jax.sharding.Sharding:
  """The sharding a stored leaf is read with, derived from its model parameter's."""
  if not isinstance(sharding, NamedSharding):
    return sharding
  spec = tuple(sharding.spec)
  if read.index is not None:
    spec = (None, *spec)  # the stacked leaf: layers axis unsharded
  elif read.stacked:
    spec = spec[1:]  # one layer of the stack
  return NamedSharding(sharding.mesh, PartitionSpec(*spec))


@functools.lru_cache(maxsize=256)
def _jitted(kind: str, dtype: np.dtype, sharding: jax.sharding.Sharding) -> Callable[..., Any]:
  """A jitted take / stack / cast with `sharding` as its output's."""

  def take(x: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False).astype(dtype)  # [...]

  def stack(*xs: jax.Array) -> jax.Array:
    return jnp.stack(xs).astype(dtype)  # [layers, ...]

  def cast(x: jax.Array) -> jax.Array:
    return x.astype(dtype)

  return jax.jit({"take": take, "stack": stack, "cast": cast}[kind], out_shardings=sharding)


def assemble(read: Read, xs: Sequence[jax.Array], aval: jax.ShapeDtypeStruct) -> jax.Array:
  """The model parameter `aval` made of the restored leaves `xs` of `read.sources`."""
  if read.index is not None:
    return _jitted("take", aval.dtype, aval.sharding)(xs[0], np.int32(read.index))
  if read.stacked:
    return _jitted("stack", aval.dtype, aval.sharding)(*xs)
  return like(xs[0], aval)


def like(x: jax.Array, aval: jax.ShapeDtypeStruct) -> jax.Array:
  """`x` with the dtype and sharding of `aval` (itself when it has them)."""
  if x.dtype == aval.dtype and x.sharding.is_equivalent_to(aval.sharding, x.ndim):
    return x
  return _jitted("cast", aval.dtype, aval.sharding)(x)
