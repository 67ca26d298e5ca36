"""Kernels for XLA:CPU: the reference math in the forms XLA:CPU runs fastest.

Same results as `reference` to float rounding (tests/kernels_test.py), chosen by
`T5Config.kernels='xla_cpu'` or by 'auto' on the CPU backend. What differs:

* Projections merge the leading [batch, length] axes into one token axis (free in
  row-major order), so that a projection and its kernel gradient are plain
  [tokens, in] @ [in, out] and [tokens, in]^T @ [tokens, out] matmuls; with two
  contracted axes, XLA:CPU wrote the gated MLP's activation gradient transposed for
  that matmul, a strided copy of every [batch, length, mlp] array. In bfloat16 these
  matmuls accumulate in float32 on row-major operands (`_matmul_f32_accumulated`),
  the form XLA:CPU hands to its fast bfloat16 kernels.
* bfloat16 attention runs both of its matmuls, and the four of their gradient, the
  same way, on row-major heads-major copies; other dtypes run the value product's
  forward on a heads-major copy of the values.
* The decode caches are heads-major ([batch, heads, length, kv]), and the
  cross-attention key cache [batch, heads, kv, length]: a decode step's two matmuls
  then read the caches in place, where a [batch, length, heads, kv] cache is
  transposed in full at every step.
* RMSNorm's scale gradient is a [1, tokens] @ [tokens, embed] matmul with ones
  instead of autodiff's reduction over every leading axis, which XLA:CPU runs as a
  strided loop.
* argmax is two vectorised reductions (a max, then the smallest index holding it)
  instead of XLA:CPU's element-at-a-time (value, index) reduction.

None of this depends on a process-wide XLA flag for its results. Its speed was
measured with the XLA:CPU options the entry points add to XLA_FLAGS on a CPU machine
(`t5x_lite.core.console.CPU_XLA_FLAGS`: the tree-reduction rewriter and YNNPACK's
reduce fusion off), under which XLA:CPU's softmax and row reductions run faster;
without them these kernels are still correct.
docs and commit messages hold the measurements.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from t5x_lite.core.types import Array, DType
from t5x_lite.kernels import reference
from t5x_lite.kernels.base import TOKENS_MAJOR, CacheLayouts, Kernels, PaddingLengths

# Decode caches: heads before length, the cross-attention key with kv before length.
CACHE = CacheLayouts(self_key='bhkd', self_value='bhkd', cross_key='bhdk', cross_value='bhkd')


# ------------------------------------------------------------------------- dense


def dense(
  inputs: Array, kernel: Array, contract: tuple[int, ...], out_dtype: DType | None = None
) -> Array:
  """`reference.dense` with the leading axes merged into one token axis.

  A kernel [*in, *out] (contract = its leading axes, every projection's but the tied
  logits') makes one [tokens, in] @ [in, out] matmul, for the attention output
  projection too, whose [heads, kv] contraction XLA:CPU otherwise runs with both
  operands transposed (a copy of the kernel in every step of a decoding loop).
  """
  explicit = len(contract)
  lead = inputs.shape[: inputs.ndim - explicit]
  matmul = contract == tuple(range(explicit))
  if len(lead) < 2 and not matmul:
    return reference.dense(inputs, kernel, contract, out_dtype)
  if not matmul:
    tokens = inputs.reshape((-1,) + inputs.shape[len(lead) :])  # [tokens, *in]
    out = reference.dense(tokens, kernel, contract, out_dtype)  # [tokens, *out]
    return out.reshape(lead + out.shape[1:])  # [*lead, *out]
  size_in = int(np.prod(inputs.shape[len(lead) :]))
  tokens = inputs.reshape(-1, size_in)  # [tokens, in]
  flat_kernel = kernel.reshape(size_in, -1)  # [in, out]
  bfloat16 = inputs.dtype == kernel.dtype == jnp.bfloat16
  if bfloat16 and out_dtype in (None, jnp.bfloat16, jnp.float32):
    out = _matmul_f32_accumulated(tokens, flat_kernel, out_dtype or inputs.dtype)
  else:
    out = jnp.dot(tokens, flat_kernel, preferred_element_type=out_dtype)  # [tokens, out]
  return out.reshape(lead + kernel.shape[explicit:])  # [*lead, *out]


def _f32_accumulated_matmul(x: Array, k: Array, out_dtype: DType) -> Array:
  """bfloat16 [..., m, n] @ [..., n, p] -> out_dtype, in the form XLA:CPU runs fastest.

  XLA:CPU hands a matmul to YNNPACK only in the plain row-major form [m, n] @ [n, p];
  there, bfloat16 operands with a float32 result run faster than float32 ones on
  CPUs with AVX512-BF16. Autodiff's backward products are g @ k^T and x^T @ g,
  which XLA folds into transposed-operand dots; those it computes in float32,
  converting both bfloat16 operands first (its own dot has no bfloat16 x bfloat16 =
  float32 kernel). So the backward pass here copies k^T and x^T into row-major arrays
  (`_row_major_transpose`) and multiplies in the plain form. Every product
  accumulates in float32 and is rounded once to its result's dtype; the cotangent is
  rounded to bfloat16 first, as autodiff rounds a bfloat16 result's cotangent (and
  as T5X's and torch autocast's bfloat16 logits are).
  """
  return jnp.matmul(x, k, preferred_element_type=jnp.float32).astype(out_dtype)


# `_f32_accumulated_matmul` with the backward pass below.
_matmul_f32_accumulated = jax.custom_vjp(_f32_accumulated_matmul, nondiff_argnums=(2,))


def _matmul_f32_accumulated_fwd(
  x: Array, k: Array, out_dtype: DType
) -> tuple[Array, tuple[Array, Array]]:
  return _matmul_f32_accumulated(x, k, out_dtype), (x, k)


def _matmul_f32_accumulated_bwd(
  out_dtype: DType, residuals: tuple[Array, Array], g: Array
) -> tuple[Array, Array]:
  del out_dtype
  x, k = residuals  # [..., m, n], [..., n, p]
  g = g.astype(x.dtype)  # [..., m, p]
  if g.ndim > 2:  # attention's: the transpose of a [batch, q, heads, kv] cotangent
    g = _row_major(g)
  dx = jnp.matmul(g, _row_major_transpose(k), preferred_element_type=jnp.float32)  # [..., m, n]
  dk = jnp.matmul(_row_major_transpose(x), g, preferred_element_type=jnp.float32)  # [..., n, p]
  return dx.astype(x.dtype), dk.astype(k.dtype)


_matmul_f32_accumulated.defvjp(_matmul_f32_accumulated_fwd, _matmul_f32_accumulated_bwd)


def _row_major_transpose(a: Array) -> Array:
  """a [..., m, n] -> [..., n, m], the last two dims swapped, copied in row-major order."""
  return _row_major(jnp.swapaxes(a, -1, -2))


def _row_major(a: Array) -> Array:
  """a, written out in row-major order.

  A transpose feeding a dot is folded into the dot's dimension numbers, or made a
  column-major layout; the 1-D array behind an optimization barrier has only one
  layout, so XLA must write the elements in order.
  """
  return jax.lax.optimization_barrier(a.reshape(-1)).reshape(a.shape)


# --------------------------------------------------------------------- attention


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
  """`reference.attention` for keys/values as projected ('bkhd') or as in `CACHE`
  (`padding` is not used: the mask bias in `biases` says the same)."""
  del padding
  tokens_major = key_axes == value_axes == TOKENS_MAJOR
  heads_major = key_axes in ('bhkd', 'bhdk') and value_axes == 'bhkd'
  if not (tokens_major or heads_major):
    return reference.attention(
      query,
      key,
      value,
      biases,
      key_axes=key_axes,
      value_axes=value_axes,
      dtype=dtype,
      logits_dtype=logits_dtype,
      dropout_rate=dropout_rate,
      dropout_rng=dropout_rng,
    )
  bfloat16 = tokens_major and query.dtype == key.dtype == value.dtype == jnp.bfloat16
  # [batch, q, heads, kv] x key -> [batch, heads, q, k]
  if bfloat16:
    q = _row_major(jnp.swapaxes(query, 1, 2))  # [batch, heads, q, kv]
    k = _row_major(jnp.transpose(key, (0, 2, 3, 1)))  # [batch, heads, kv, k]
    logits = _matmul_f32_accumulated(q, k, logits_dtype)
  elif tokens_major:
    logits = jnp.einsum('bqhd,bkhd->bhqk', query, key, preferred_element_type=logits_dtype)
  else:
    q = jnp.swapaxes(query, 1, 2)  # [batch, heads, q, kv]
    logits = jnp.einsum(f'bhqd,{key_axes}->bhqk', q, key, preferred_element_type=logits_dtype)
  weights = reference.softmax_weights(logits, biases, dtype, dropout_rate, dropout_rng)
  # [batch, heads, q, k] x value -> [batch, q, heads, kv]
  if bfloat16 and weights.dtype == jnp.bfloat16:
    v = _row_major(jnp.swapaxes(value, 1, 2))  # [batch, heads, k, kv]
    out = _matmul_f32_accumulated(weights, v, weights.dtype)  # [batch, heads, q, kv]
    return jnp.swapaxes(out, 1, 2)
  if tokens_major:
    return _values_heads_major_forward(weights, value)
  # [batch, heads, q, kv], then the (small) output transposed
  return jnp.swapaxes(jnp.einsum('bhqk,bhkd->bhqd', weights, value), 1, 2)


@jax.custom_vjp
def _values_heads_major_forward(weights: Array, value: Array) -> Array:
  """`einsum('bhqk,bkhd->bqhd', weights, value)`, the forward with [batch, heads, k, kv] values.

  XLA:CPU multiplies the [batch, k, heads, kv] values in place more slowly than a
  [batch, heads, k, kv] copy of them, copy included, with the same result to the bit.
  That copy's backward is slower than the plain einsum's, so the backward is the plain
  einsum's vjp; its value gradient may differ from autodiff's in the last bit (XLA
  fuses it differently).
  """
  return jnp.swapaxes(jnp.einsum('bhqk,bhkd->bhqd', weights, jnp.swapaxes(value, 1, 2)), 1, 2)


def _plain_values(weights: Array, value: Array) -> Array:
  return jnp.einsum('bhqk,bkhd->bqhd', weights, value)


def _values_heads_major_forward_fwd(
  weights: Array, value: Array
) -> tuple[Array, tuple[Array, Array]]:
  return _values_heads_major_forward(weights, value), (weights, value)


def _values_heads_major_forward_bwd(
  residuals: tuple[Array, Array], g: Array
) -> tuple[Array, Array]:
  _, vjp = jax.vjp(_plain_values, *residuals)
  return vjp(g)


_values_heads_major_forward.defvjp(_values_heads_major_forward_fwd, _values_heads_major_forward_bwd)


# ----------------------------------------------------------------- norm, argmax


def rms_norm(x: Array, scale: Array, epsilon: float, dtype: DType) -> Array:
  """`reference.rms_norm` whose scale gradient is a matmul (`_scaled`)."""
  x32 = jnp.asarray(x, jnp.float32)
  mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)  # [..., 1]
  y = x32 * jax.lax.rsqrt(mean_square + epsilon)  # [..., embed]
  return _scaled(y, jnp.asarray(scale, jnp.float32)).astype(dtype)


@jax.custom_vjp
def _scaled(y: Array, scale: Array) -> Array:
  """y [..., embed] * scale [embed]; the backward sums scale's gradient as a matmul.

  Autodiff sums g * y over every leading axis, a reduction to [embed] that XLA:CPU
  runs as a slow strided loop (faster with its tree-reduction rewriter, which slows
  the softmax and every row reduction down). A [1, tokens] @ [tokens, embed] matmul
  with ones sums the same products, faster than either; only the order of the sum
  differs from autodiff's.
  """
  return y * scale


def _scaled_fwd(y: Array, scale: Array) -> tuple[Array, tuple[Array, Array]]:
  return y * scale, (y, scale)


def _scaled_bwd(residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
  y, scale = residuals
  rows = g.size // g.shape[-1]
  products = (g * y).reshape(rows, g.shape[-1])  # [tokens, embed]
  d_scale = jnp.ones((1, rows), products.dtype) @ products  # [1, embed]
  return g * scale, d_scale.reshape(scale.shape)


_scaled.defvjp(_scaled_fwd, _scaled_bwd)


def argmax(x: Array) -> Array:
  """`reference.argmax` as two reductions that XLA:CPU vectorises.

  The index of the first maximum (of the first NaN, if a row has one), like
  `jnp.argmax`: a max, then the smallest index holding it, where XLA:CPU runs
  `jnp.argmax`'s (value, index) reduction one element at a time.

  Args:
    x: [..., n] floating point.

  Returns:
    [...] int32 indices.
  """
  n = x.shape[-1]
  top = jnp.max(x, axis=-1, keepdims=True)  # [..., 1]; XLA:CPU may skip NaNs
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)  # [..., n]
  # One reduction: a NaN's key is its index, a maximum's its index + n, any other 2n.
  key = jnp.where(jnp.isnan(x), index, jnp.where(x == top, index + n, 2 * n))  # [..., n]
  first = jnp.min(key, axis=-1)  # [...]
  return jnp.where(first >= n, first - n, first)


KERNELS = Kernels(
  name='xla_cpu',
  dense=dense,
  attention=attention,
  rms_norm=rms_norm,
  argmax=argmax,
  cache=CACHE,
)
