"""Kernels for GPUs: T5's attention as one fused `jax.nn.dot_product_attention` call.

Chosen by `T5Config.kernels='xla_gpu'`. 'auto' still picks 'reference' on a GPU
(`registry.AUTO`): this set trains faster in both shapes measured on a GPU
(docs/performance.md), but until its decoded tokens are compared with the reference's
there, the plain math stays the default.
RMSNorm and argmax are the reference's (XLA's fusions take them as they are), and so
are the projections but for one backward (below); what differs is attention:

* The additive biases the layers hand over (masks and T5's relative position bias,
  see `base.AttentionFn`) are summed into the one `bias` of
  `jax.nn.dot_product_attention(query, key, value, bias=..., scale=1.0)`: T5 has no
  1/sqrt(head_dim) on its logits, and its position bias is a learned parameter, so
  its gradient must flow (the cuDNN kernel returns the bias gradient).
* On a GPU it runs with implementation='cudnn' (cuDNN's fused flash attention: the
  [batch, heads, q, k] logits and weights never reach memory, forward or backward)
  where cuDNN takes the shapes (`implementation`): bfloat16 or float16 queries, keys
  and values, a head size that is a multiple of 8 up to 128, and, with a bias, even
  query and key lengths (the cuDNN condition for a bias gradient; a decode step's
  single query is exempt, it has no gradient). cuDNN takes its bias in the queries'
  dtype: the masks' finite `MASK_BIAS` stays below every logit there, and T5's
  bfloat16 models compute their position bias in bfloat16 already. cuDNN's softmax
  is float32 whatever `logits_dtype` says. Where jax finds no usable cuDNN while
  tracing (its checks raise), a warning says so and XLA's implementation runs.
  Elsewhere, and on other backends (the CPU, where the tests check this set against
  the reference), implementation='xla': the same math as `reference.attention` in
  jax's own form (float32 logits and softmax, weights cast to the values' dtype).
* Where the layers say a mask is only right padding (`base.PaddingLengths`: the
  encoder's self-attention and the decoder's cross-attention over unpacked rows), the
  lengths replace that mask (`query_seq_lengths`, `key_value_seq_lengths`), so the one
  bias left is T5's position bias [1, heads, q, k] (or none, in cross-attention), which
  cuDNN reads and differentiates without a [batch, heads, q, k] copy (measured with
  tools/attention_benchmark.py: docs/performance.md). The padded queries' outputs are
  zeros. Packed rows (segment masks), causal masks and decode steps keep the summed bias.
* Attention dropout (a fine-tuning option; T5 1.1 pre-trains without it) has no place
  in that call, so with a dropout key the reference attention runs instead; so it does
  for operands of mixed dtypes and for other key/value layouts.
* The decode caches keep the projections' layout ('bkhd'), which is the call's.

The projection that gives float32 out of 16-bit operands (the output layer: float32
logits for the loss) differs in its backward only: the float32 cotangent of the logits
is cast to the operands' dtype before the two gradient matmuls, as in T5X, whose
bfloat16 logits are cast to float32 after the projection. The reference's backward
runs them with the float32 cotangent, which makes the logits' input gradient a float32
(TF32 on a GPU) matmul, the slowest op of T5 1.1 base's step on a GPU (docs/performance.md).
The forward is the reference's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from absl import logging

from t5x_lite.core.types import Array, DType
from t5x_lite.kernels import reference
from t5x_lite.kernels.base import TOKENS_MAJOR, CacheLayouts, Kernels, PaddingLengths

# Query/key/value dtypes cuDNN's fused attention takes.
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
# Largest head size of cuDNN's fused attention on every GPU it supports (Hopper: 256).
CUDNN_MAX_HEAD_DIM = 128


def implementation(query: Array, key: Array, bias: Array | None, backend: str) -> str:
  """'cudnn' where cuDNN's fused attention takes these operands on `backend`, else 'xla'.

  Args:
    query: [batch, q, heads, kv].
    key: [batch, k, heads, kv].
    bias: the summed bias [batch|1, heads|1, q, k], or None.
    backend: the jax backend the program is compiled for ('gpu' for cuDNN).

  Returns:
    The `implementation` argument of `jax.nn.dot_product_attention`.
  """
  head_dim = query.shape[-1]
  length_q, length_k = query.shape[1], key.shape[1]
  supported = (
    backend == 'gpu'
    and query.dtype == key.dtype
    and any(query.dtype == d for d in CUDNN_DTYPES)
    and head_dim % 8 == 0
    and head_dim <= CUDNN_MAX_HEAD_DIM
    and (bias is None or length_q == 1 or (length_q % 2 == 0 and length_k % 2 == 0))
  )
  return 'cudnn' if supported else 'xla'


def summed_bias(biases: Sequence[Array], length_q: int) -> Array | None:
  """The sum of additive biases broadcastable to [batch, heads, q, k], in float32.

  Returns:
    [batch|1, heads|1, q, k] (the query axis made whole, as cuDNN needs), or None.
  """
  if not biases:
    return None
  total = biases[0].astype(jnp.float32)
  for bias in biases[1:]:
    total = total + bias.astype(jnp.float32)
  total = jnp.reshape(total, (1,) * (4 - total.ndim) + total.shape)
  return jnp.broadcast_to(total, total.shape[:2] + (length_q, total.shape[3]))


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
  """Unscaled dot-product attention (see `base.AttentionFn`) -> [batch, q, heads, kv],
  fused by `jax.nn.dot_product_attention` (see the module docstring)."""
  dropout = dropout_rng is not None and dropout_rate > 0.0
  layouts = key_axes == value_axes == TOKENS_MAJOR
  dtypes = query.dtype == key.dtype == value.dtype == jnp.dtype(dtype)
  if dropout or not layouts or not dtypes:
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
  query_lengths = key_lengths = None  # [batch] each, where they replace the padding mask
  if padding is not None and biases:
    # biases[0] is the padding mask of these lengths (base.AttentionFn): drop it.
    biases = biases[1:]
    query_lengths, key_lengths = padding
  bias = summed_bias(biases, query.shape[1])  # [batch|1, heads|1, q, k]
  out = None
  if implementation(query, key, bias, jax.default_backend()) == 'cudnn':
    cudnn_bias = None if bias is None else bias.astype(query.dtype)
    try:
      # [batch, q, heads, kv] x [batch, k, heads, kv] (x2) -> [batch, q, heads, kv]
      out = jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias=cudnn_bias,
        scale=1.0,
        query_seq_lengths=query_lengths,
        key_value_seq_lengths=key_lengths,
        implementation='cudnn',
      )
    except (NotImplementedError, RuntimeError) as e:  # raised while tracing: no cuDNN
      logging.warning(
        "xla_gpu attention: cuDNN's fused attention refused query %s, key %s (%s); XLA's runs",
        query.shape,
        key.shape,
        e,
      )
  if out is None:
    # [batch, q, heads, kv] x [batch, k, heads, kv] (x2) -> [batch, q, heads, kv]
    out = jax.nn.dot_product_attention(
      query,
      key,
      value,
      bias=bias,
      scale=1.0,
      query_seq_lengths=query_lengths,
      key_value_seq_lengths=key_lengths,
      implementation='xla',
    )
  if query_lengths is not None:
    # Padded queries: zeros (cuDNN leaves their rows undefined; their gradient is zero).
    real = jnp.arange(query.shape[1])[None, :] < query_lengths[:, None]  # [batch, q]
    out = jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))
  return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense_16bit_cotangent(
  inputs: Array, kernel: Array, contract: tuple[int, ...], out_dtype: DType
) -> Array:
  """`reference.dense` whose backward takes the cotangent in the operands' dtype."""
  return reference.dense(inputs, kernel, contract, out_dtype)


def _dense_fwd(
  inputs: Array, kernel: Array, contract: tuple[int, ...], out_dtype: DType
) -> tuple[Array, tuple[Array, Array]]:
  return reference.dense(inputs, kernel, contract, out_dtype), (inputs, kernel)


def _dense_bwd(
  contract: tuple[int, ...], out_dtype: DType, residuals: tuple[Array, Array], cotangent: Array
) -> tuple[Array, Array]:
  del out_dtype
  inputs, kernel = residuals
  _, vjp = jax.vjp(lambda x, k: reference.dense(x, k, contract), inputs, kernel)
  return vjp(cotangent.astype(inputs.dtype))  # [..., *in] and the kernel's shape


_dense_16bit_cotangent.defvjp(_dense_fwd, _dense_bwd)


def dense(
  inputs: Array, kernel: Array, contract: tuple[int, ...], out_dtype: DType | None = None
) -> Array:
  """inputs [..., *in] x kernel -> [..., *out] (see `base.DenseFn`): the reference's,
  with a 16-bit cotangent where 16-bit operands give float32 (the module docstring)."""
  sixteen_bit = any(inputs.dtype == d for d in CUDNN_DTYPES) and kernel.dtype == inputs.dtype
  if out_dtype is None or not sixteen_bit or jnp.dtype(out_dtype) != jnp.float32:
    return reference.dense(inputs, kernel, contract, out_dtype)
  return _dense_16bit_cotangent(inputs, kernel, contract, out_dtype)


KERNELS = Kernels(
  name='xla_gpu',
  dense=dense,
  attention=attention,
  rms_norm=reference.rms_norm,
  argmax=reference.argmax,
  cache=CacheLayouts(),  # keys and values as projected: the call's [batch, k, heads, kv]
)
