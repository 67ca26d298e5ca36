"""What a backend implements: the `Kernels` set of primitives the layers call.

The layers (`t5x_lite.nn.layers`) hold the parameters and say what is computed; the
callables of one `Kernels` compute it. Every set must give the reference's results to
float rounding (tests/kernels_test.py checks the loss, gradients and greedy decodes of
each against `reference`).

Key/value layouts are strings of axis letters: b batch, k key position, h heads,
d head dim. The projections give 'bkhd'; a set's `CacheLayouts` says how its decode
caches hold keys and values (batch always first: beam search expands and gathers the
caches' rows), and its attention takes either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import jax.numpy as jnp

from t5x_lite.core.types import Array, DType

# The layout of keys and values as the projections give them.
TOKENS_MAJOR = 'bkhd'


class DenseFn(Protocol):
  """A bias-free projection: contracts the inputs' trailing axes with kernel axes.

  Args:
    inputs: [..., *in], the last len(contract) axes contracted.
    kernel: the kernel; its axes `contract` (in that order) match the inputs' trailing
      axes, its other axes are the outputs' (in their order).
    contract: the kernel axes contracted, e.g. (0,) for [embed, mlp], (0, 1) for
      [heads, kv, embed], (1,) for a tied embedding [vocab, embed].
    out_dtype: the result's dtype (accumulated in it); None: the inputs'.

  Returns:
    [..., *out].
  """

  def __call__(
    self, inputs: Array, kernel: Array, contract: tuple[int, ...], out_dtype: DType | None
  ) -> Array: ...


class PaddingLengths(NamedTuple):
  """Where an attention's mask is only right padding (unpacked rows), its lengths.

  The layers hand these to `AttentionFn` beside the mask bias they make, so that a
  kernel that takes sequence lengths (cuDNN's fused attention) can use them in place of
  a [batch, 1, q, k] bias; the others ignore them.

  Attributes:
    query: [batch] int32, the real queries of each row (the rest are padding).
    key: [batch] int32, the real keys of each row.
  """

  query: Array
  key: Array


class AttentionFn(Protocol):
  """Unscaled dot-product attention with additive biases (T5: no 1/sqrt(head_dim)).

  softmax(query . key + sum(biases)) . value, the logits, biases and softmax in
  `logits_dtype`, the weights cast to `dtype` for the value product.

  Args:
    query: [batch, q, heads, kv].
    key: laid out as `key_axes` says.
    value: laid out as `value_axes` says.
    biases: additive float32 biases broadcastable to [batch, heads, q, k].
    key_axes: the key's layout, 'bkhd' or one of the set's `CacheLayouts`.
    value_axes: the value's layout.
    dtype: dtype of the weights in the value product.
    logits_dtype: dtype of the logits and the softmax.
    dropout_rate: dropout on the weights (its mask broadcast over queries, as T5X's).
    dropout_rng: PRNG key of the dropout; None: no dropout.
    padding: None, or where the rows are unpacked and right-padded, their lengths; then
      `biases[0]` is exactly the padding mask they make (real queries see real keys),
      and a kernel may use the lengths in its place. The queries past a row's length
      are padding, whose outputs no loss reads: such a kernel may give them zeros.

  Returns:
    [batch, q, heads, kv].
  """

  def __call__(
    self,
    query: Array,
    key: Array,
    value: Array,
    biases: Sequence[Array],
    *,
    key_axes: str,
    value_axes: str,
    dtype: DType,
    logits_dtype: DType,
    dropout_rate: float,
    dropout_rng: Array | None,
    padding: PaddingLengths | None = None,
  ) -> Array: ...


class RMSNormFn(Protocol):
  """T5's RMSNorm: x / sqrt(mean(x^2) + epsilon) * scale, in float32, cast to `dtype`.

  Args:
    x: [..., embed].
    scale: [embed].
    epsilon: added to the mean square.
    dtype: the result's dtype.
  """

  def __call__(self, x: Array, scale: Array, epsilon: float, dtype: DType) -> Array: ...


class ArgmaxFn(Protocol):
  """`jnp.argmax(x, axis=-1)`: the index of the first maximum (of the first NaN, if any).

  Args:
    x: [..., n] floating point.

  Returns:
    [...] int32.
  """

  def __call__(self, x: Array) -> Array: ...


@dataclasses.dataclass(frozen=True)
class CacheLayouts:
  """How the decode caches hold keys and values (axis letters, see the module docstring).

  Attributes:
    self_key: a self-attention key cache.
    self_value: a self-attention value cache.
    cross_key: the cross-attention key cache (the projected encoder output).
    cross_value: the cross-attention value cache.
  """

  self_key: str = TOKENS_MAJOR
  self_value: str = TOKENS_MAJOR
  cross_key: str = TOKENS_MAJOR
  cross_value: str = TOKENS_MAJOR

  def __post_init__(self):
    for field in dataclasses.fields(self):
      axes = getattr(self, field.name)
      if sorted(axes) != sorted(TOKENS_MAJOR) or axes[0] != 'b':
        raise ValueError(f'CacheLayouts.{field.name}: {axes!r} is not b + a permutation of khd')


@dataclasses.dataclass(frozen=True)
class Kernels:
  """One backend's implementations of the network's primitives.

  Attributes:
    name: the `T5Config.kernels` value that selects the set.
    dense: every projection's matmul (`DenseFn`).
    attention: logits, softmax and the value product (`AttentionFn`).
    rms_norm: T5's layer norm (`RMSNormFn`).
    argmax: greedy decoding's and the accuracy metric's argmax (`ArgmaxFn`).
    cache: the decode caches' layouts.
  """

  name: str
  dense: DenseFn
  attention: AttentionFn
  rms_norm: RMSNormFn
  argmax: ArgmaxFn
  cache: CacheLayouts = CacheLayouts()


def to_layout(x: Array, axes: str) -> Array:
  """Keys or values [batch, k, heads, kv] ('bkhd') -> laid out as `axes`."""
  return jnp.transpose(x, [TOKENS_MAJOR.index(a) for a in axes])
