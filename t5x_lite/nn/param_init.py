"""A network's initial parameters with the random draws batched, bit for bit flax's.

Flax initialises parameters one by one: each takes its key by folding a hash of its path
into the root key, then calls its initialiser with it. Under `jit` each of those is its
own threefry hash, unrolled into the program, so the init program of a T5 grows with its
parameter count (two hashes a parameter), and its compile time with it.

`init_params` gives the same values from a program with one hash for every parameter's
key and one per group of parameters that share an initialiser, shape and dtype (a
network's layers repeat the same kernels), each group's initialiser vmapped over its
keys. It traces the module's `init` with a stand-in root key that records the data flax
folds into it instead of hashing it, while the layers' initialisers (wrapped by
`deferrable`, which `layers.partitioned_param` does for every parameter) record their
call and return zeros; it then draws all the recorded values at once and puts them in
the zeros' place. threefry is elementwise over keys and counters, so batching the keys
changes no bit of the hashes; the float math after them gave the same values bit for
bit at XLA's default CPU settings, and within rounding at the tests' compile flags
(`tests/param_init_test.py` checks every architecture against flax's own `init`).

A module that creates parameters inside a lifted transform (`nn.scan` over layers,
`nn.remat`: each traces its body apart) gets flax's own per-parameter init; a random
draw from the stand-in key anywhere but in a deferrable initialiser raises.
"""

import contextvars
import dataclasses
import functools
import types
from collections.abc import Callable, Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.extend import random as jex_random

from t5x_lite.core.types import Array, Initializer, PyTree


class RecordingKeyDrawError(RuntimeError):
  """Random values drawn from `init_params`' stand-in key: a parameter (or anything else
  drawing from the 'params' or 'dropout' key at init) bypassed `deferrable`."""


def _draw_from_recording_key(*_: Any) -> Array:
  raise RecordingKeyDrawError(
    'param_init: a parameter initialiser drew from the recording key; create parameters '
    'through layers.partitioned_param (param_init.deferrable), or pass batched=False'
  )


class _InsideLiftedTransform(Exception):
  """A parameter created in a trace of its own (`nn.scan`, `nn.remat`, ...), or the key
  split for one: its zeros would reach the params tree as that transform's outputs, out
  of the draw's reach."""


def _split(key_data: Array, shape: tuple[int, ...]) -> Array:
  """Splitting the stand-in key is what `nn.scan`'s `split_rngs` does: a lifted transform."""
  raise _InsideLiftedTransform


def _record_fold_in(key_data: Array, data: Array | int) -> Array:
  """The stand-in key's fold-in: keeps the data (uint32 [1]) for the batched hash."""
  del key_data  # always the root's: flax folds each parameter's whole path in at once
  return jnp.reshape(jnp.asarray(data, jnp.uint32), (1,))


# A PRNG implementation whose key (uint32 [1]) is the data of the one fold-in flax applies
# to the root key for each parameter (`flax.core.scope.LazyRng`: the path hashed to 32 bits).
# It lowers to nothing but that data: a draw from it raises, a split means a lifted transform.
_RECORDING_KEY = jex_random.define_prng_impl(
  key_shape=(1,),
  seed=lambda seed: jnp.zeros((1,), jnp.uint32),
  split=_split,
  random_bits=_draw_from_recording_key,
  fold_in=_record_fold_in,
  name='t5x_lite_param_init_recording',
  tag='param_init_recording',
)


@dataclasses.dataclass(frozen=True)
class _Draw:
  """One parameter's initialiser call, recorded for the batched draw."""

  fold_data: Array  # uint32 []: what flax folds into the root key for this parameter
  init: Callable[..., Array]
  args: tuple[Any, ...]  # the initialiser's arguments after the key (shape, dtype)
  kwargs: dict[str, Any]
  signature: Hashable  # equal for calls that compute the same function of the key
  placeholder: Array  # the zeros returned in its place


@dataclasses.dataclass
class _Recording:
  trace: Any  # the trace `init_params` was called in (`get_opaque_trace_state`)
  draws: list[_Draw] = dataclasses.field(default_factory=list)
  shapes: dict[Hashable, jax.ShapeDtypeStruct] = dataclasses.field(default_factory=dict)


_RECORDING: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar(
  't5x_lite_param_init_recording', default=None
)

# The key type the signatures of initialisers are traced with (any one type serves).
_SIGNATURE_KEY = jax.ShapeDtypeStruct((2,), jnp.uint32)


class _NoStructure(Exception):
  """A value `_structure` cannot compare by value."""


def _structure(value: Any) -> Hashable:
  """A hashable stand-in for `value`, equal only for values that compute alike: functions
  by their code, defaults and closures, partials by their parts, plain data by value."""
  if isinstance(value, functools.partial):
    keywords = tuple(sorted(value.keywords.items()))
    return ('partial', _structure(value.func), _structure(value.args), _structure(keywords))
  if isinstance(value, types.FunctionType):
    try:
      cells = tuple(_structure(cell.cell_contents) for cell in value.__closure__ or ())
    except ValueError as empty_cell:
      raise _NoStructure from empty_cell
    keyword_defaults = tuple(sorted((value.__kwdefaults__ or {}).items()))
    defaults = (_structure(value.__defaults__ or ()), _structure(keyword_defaults))
    return ('function', value.__module__, value.__qualname__, value.__code__, cells, defaults)
  if isinstance(value, (tuple, list)):
    return (type(value).__name__, tuple(_structure(item) for item in value))
  if isinstance(value, dict):
    return ('dict', tuple((key, _structure(item)) for key, item in sorted(value.items())))
  if isinstance(value, float):
    return ('float', value.hex())  # tells 0.0 from -0.0
  if value is None or isinstance(value, (bool, int, str, type, np.dtype)):
    return (type(value), value)
  raise _NoStructure


def _signature(
  init: Callable[..., Array], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Hashable:
  """Equal for two initialiser calls that compute the same function of their key: by the
  initialisers' structure, else by their traced programs and constants."""
  try:
    return ('structure', _structure(init), _structure(args), _structure(kwargs))
  except (_NoStructure, RecursionError, TypeError):  # TypeError: unsortable dict keys
    pass
  closed = jax.make_jaxpr(lambda key: init(key, *args, **kwargs))(_SIGNATURE_KEY)
  consts = []
  for const in closed.consts:
    try:
      value = np.asarray(const)
    except jax.errors.TracerArrayConversionError:
      return ('traced', object())  # a traced constant: a group of its own
    consts.append((value.dtype.str, value.shape, value.tobytes()))
  return ('program', str(closed.jaxpr), tuple(consts))


def _is_recording_key(key: Any) -> bool:
  return (
    isinstance(key, jax.Array)
    and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    and jax.random.key_impl(key) == _RECORDING_KEY
  )


def deferrable(init: Initializer) -> Initializer:
  """`init`, whose call `init_params` records and draws with the others in one batch.

  Called with any other key, it is `init` itself.
  """

  def maybe_deferred(key: Array, *args: Any, **kwargs: Any) -> Array:
    recording = _RECORDING.get()
    if recording is None or not _is_recording_key(key):
      return init(key, *args, **kwargs)
    if jex_core.get_opaque_trace_state() != recording.trace:
      raise _InsideLiftedTransform
    signature = _signature(init, args, kwargs)
    if signature not in recording.shapes:
      recording.shapes[signature] = jax.eval_shape(
        lambda k: init(k, *args, **kwargs), _SIGNATURE_KEY
      )
    shape = recording.shapes[signature]
    zeros = jnp.zeros(shape.shape, shape.dtype)
    fold_data = jax.random.key_data(key)[0]
    recording.draws.append(_Draw(fold_data, init, args, kwargs, signature, zeros))
    return zeros

  return maybe_deferred


def _draw_all(rng: Array, draws: list[_Draw]) -> dict[int, Array]:
  """Each draw's values, by `id` of its placeholder: one batched hash for the keys
  (ordered by group), then each group of equal initialisers vmapped over its keys."""
  groups: dict[Hashable, list[_Draw]] = {}
  for draw in draws:
    groups.setdefault(draw.signature, []).append(draw)
  ordered = [draw for members in groups.values() for draw in members]
  fold_data = jnp.stack([draw.fold_data for draw in ordered])  # [draws]
  keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, fold_data)  # [draws, *key]
  values: dict[int, Array] = {}
  start = 0
  for members in groups.values():
    first = members[0]
    group_keys = keys[start : start + len(members)]  # [group, *key]
    drawn = jax.vmap(lambda k, d=first: d.init(k, *d.args, **d.kwargs))(group_keys)
    for position, draw in enumerate(members):
      values[id(draw.placeholder)] = drawn[position]  # [*shape]
    start += len(members)
  return values


def init_params(
  module: nn.Module, rng: Array, *args: Any, batched: bool = True, **kwargs: Any
) -> PyTree:
  """`module.init({'params': rng, 'dropout': rng}, *args, **kwargs)['params']`.

  With `batched`, the same values from one batched draw (the module docstring): every
  parameter that draws random values must be created through a `deferrable`
  initialiser, and stored as that initialiser returned it. A parameter created inside
  a lifted transform makes it flax's per-parameter init instead.
  """
  if not batched:
    return module.init({'params': rng, 'dropout': rng}, *args, **kwargs)['params']
  state = _Recording(trace=jex_core.get_opaque_trace_state())
  token = _RECORDING.set(state)
  try:
    key = jax.random.wrap_key_data(jnp.zeros((1,), jnp.uint32), impl=_RECORDING_KEY)
    params = module.init({'params': key, 'dropout': key}, *args, **kwargs)['params']
  except _InsideLiftedTransform:
    params = None
  finally:
    _RECORDING.reset(token)
  if params is None:
    return init_params(module, rng, *args, batched=False, **kwargs)
  # Draws whose parameter the module dropped (`nn.map_variables`, as the shared
  # encoder-decoder does with the decoder's copies) are not drawn at all.
  stored = {id(leaf) for leaf in jax.tree.leaves(params)}
  draws = [draw for draw in state.draws if id(draw.placeholder) in stored]
  if not draws:
    return params
  values = _draw_all(rng, draws)
  return jax.tree.map(lambda leaf: values.get(id(leaf), leaf), params)
