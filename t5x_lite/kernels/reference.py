"""The reference kernels: T5's primitives in their plain JAX form, on every backend.

Each function is the math as written, left to the compiler: one `dot_general` per
projection, two einsums and a softmax per attention, autodiff for every gradient. Its
logits equal HF transformers' T5 (tests/hf_interop_test.py); every other set is checked
against it (tests/kernels_test.py) and measured against it (tools/benchmark.py
--kernels=reference,...).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from t5x_lite.core.types import Array, DType
from t5x_lite.kernels.base import CacheLayouts, Kernels, PaddingLengths


def dense(
  inputs: Array, kernel: Array, contract: tuple[int, ...], out_dtype: DType | None = None
) -> Array:
  """inputs [..., *in] x kernel -> [..., *out] (see `base.DenseFn`)."""
  trailing = tuple(range(inputs.ndim - len(contract), inputs.ndim))
  return jax.lax.dot_general(
    inputs, kernel, ((trailing, contract), ((), ())), preferred_element_type=out_dtype
  )


def attention_dropout(weights: Array, rate: float, rng: Array | None) -> Array:
  """Dropout on attention weights [batch, heads, q, k], its mask shared by all queries."""
  if rng is None or rate == 0.0:
    return weights
  keep_prob = 1.0 - rate
  keep_shape = weights.shape[:-2] + (1,) + weights.shape[-1:]  # [batch, heads, 1, k]
  keep = jax.random.bernoulli(rng, keep_prob, keep_shape)
  return weights * (keep.astype(weights.dtype) / jnp.asarray(keep_prob, weights.dtype))


def softmax_weights(
  logits: Array,
  biases: Sequence[Array],
  dtype: DType,
  dropout_rate: float,
  dropout_rng: Array | None,
) -> Array:
  """softmax(logits + sum(biases)) over keys, in the logits' dtype, cast to `dtype`,
  with dropout: logits [batch, heads, q, k] -> weights, same shape."""
  for bias in biases:
    logits = logits + bias.astype(logits.dtype)
  weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
  return attention_dropout(weights, dropout_rate, dropout_rng)


def attention(
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
) -> Array:
  """Unscaled dot-product attention (see `base.AttentionFn`) -> [batch, q, heads, kv].

  `padding` is not used: the mask bias in `biases` says the same.
  """
  del padding
  # [batch, q, heads, kv] x key -> [batch, heads, q, k]
  logits = jnp.einsum(f'bqhd,{key_axes}->bhqk', query, key, preferred_element_type=logits_dtype)
  weights = softmax_weights(logits, biases, dtype, dropout_rate, dropout_rng)
  # [batch, heads, q, k] x value -> [batch, q, heads, kv]
  return jnp.einsum(f'bhqk,{value_axes}->bqhd', weights, value)


def rms_norm(x: Array, scale: Array, epsilon: float, dtype: DType) -> Array:
  """x [..., embed] -> x / sqrt(mean(x^2) + epsilon) * scale, in float32 inside."""
  x32 = jnp.asarray(x, jnp.float32)
  mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)  # [..., 1]
  y = x32 * jax.lax.rsqrt(mean_square + epsilon)  # [..., embed]
  return (y * jnp.asarray(scale, jnp.float32)).astype(dtype)


def argmax(x: Array) -> Array:
  """x [..., n] -> [...] int32, the first maximum's index."""
  return jnp.argmax(x, axis=-1).astype(jnp.int32)


KERNELS = Kernels(
  name='reference',
  dense=dense,
  attention=attention,
  rms_norm=rms_norm,
  argmax=argmax,
  cache=CacheLayouts(),  # keys and values as the projections give them: 'bkhd'
)
