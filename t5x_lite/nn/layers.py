"""T5 building blocks in Flax linen: projections, embedding, RMSNorm, MLP, adapter,
relative position biases and attention masks (attention itself: `t5x_lite.nn.attention`).

Every parameter is created through `nn.with_logical_partitioning` with the logical
axis names of the shared contract ('embed', 'heads', 'kv', 'mlp', 'vocab',
'relpos_buckets'); `t5x_lite.training.partitioning` maps those names to mesh axes.
No layer has a bias term. Attention logits carry no 1/sqrt(head_dim) factor: it is
folded into the query kernel's initialiser, as in T5 and T5X.

The layers say what is computed; their `kernels` field (a `t5x_lite.kernels.base.Kernels`:
the reference set by default, the choice of `T5Config.kernels` in a network) computes it: the
projections' matmuls and RMSNorm here, attention and the caches' layout in
`t5x_lite.nn.attention`, as flaxformer's `attention_fn` and flax's `dot_general` fields do.
"""

import functools
from collections.abc import Callable, Sequence
from typing import cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_lite.core.types import Array, DType, Initializer, PyTree, Shape
from t5x_lite.kernels import reference
from t5x_lite.kernels.base import Kernels
from t5x_lite.nn import param_init

# Additive bias used to mask out attention logits (finite, so fully masked rows stay finite).
MASK_BIAS = -1e10


def mlp_kernel_init() -> Initializer:
  """T5X's initialiser for 2-D kernels (MLP and untied logits): fan-in truncated normal."""
  return nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal')


def attention_kernel_init(scale: float, projection: str) -> Initializer:
  """Fan-in normal initialiser for 3-D attention kernels.

  Args:
    scale: variance scale; the query kernel uses 1/head_dim so that q.k needs no
      1/sqrt(head_dim) at run time.
    projection: 'in' for [embed, heads, kv] kernels (fan-in = embed), 'out' for the
      [heads, kv, embed] output kernel (fan-in = heads * kv).
  """
  if projection == 'in':
    return nn.initializers.variance_scaling(scale, 'fan_in', 'normal', in_axis=0, out_axis=(1, 2))
  return nn.initializers.variance_scaling(scale, 'fan_in', 'normal', in_axis=(0, 1), out_axis=2)


def partitioned_param(
  module: nn.Module,
  name: str,
  init: Initializer,
  axes: tuple[str, ...],
  shape: Shape,
  dtype: DType,
) -> Array:
  """`module.param(name, ...)`, created with the logical axis names `axes` (the
  partitioning's), returned unboxed."""
  deferred = param_init.deferrable(init)
  boxed = module.param(name, nn.with_logical_partitioning(deferred, axes), shape, dtype)
  return cast(Array, boxed)  # `param` unboxes the nn.LogicallyPartitioned it creates


@functools.lru_cache(maxsize=8)
def abstract_boxed_params(init_params: Callable[[Array], PyTree]) -> PyTree:
  """`init_params` traced with an abstract PRNG key: the boxed params as shapes.

  Nothing is allocated. Traced once per callable (a model's bound `init_params` is the
  same key on every call): the entry points ask for the same shapes and axes several
  times while they set up (`BaseModel.param_axes`, `Partitioner.abstract_params`), and
  each trace of a network costs a fraction of a second of Python.

  Args:
    init_params: rng -> boxed tree (`nn.LogicallyPartitioned` leaves, made by
      `partitioned_param`), e.g. a model's `init_params` or `init_aux_state`.

  Returns:
    The tree `init_params` returns, with `jax.ShapeDtypeStruct` values.
  """
  return jax.eval_shape(init_params, jax.ShapeDtypeStruct((2,), jnp.uint32))


class Projection(nn.Module):
  """A bias-free linear map of the inputs' trailing axes: [..., *in] -> [..., *features].

  The kernel is [*in, *features]; `kernel_axes` names its axes, the first
  len(kernel_axes) - len(features) of them the contracted input axes.

  Attributes:
    features: the output's trailing shape.
    kernel_axes: logical axis names of the kernel [*in, *features].
    kernel_init: initialiser of the kernel (unboxed).
    kernels: the backend's primitives (`kernels.dense` multiplies).
    dtype: computation dtype.
    param_dtype: storage dtype of the kernel.
    out_dtype: if set, the product accumulates into and returns this dtype.
  """

  features: tuple[int, ...]
  kernel_axes: tuple[str, ...]
  kernel_init: Initializer = mlp_kernel_init()
  kernels: Kernels = reference.KERNELS
  dtype: DType = jnp.float32
  param_dtype: DType = jnp.float32
  out_dtype: DType | None = None

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """Applies the projection to inputs [..., *in]."""
    num_in = len(self.kernel_axes) - len(self.features)
    shape = inputs.shape[inputs.ndim - num_in :] + tuple(self.features)  # [*in, *features]
    kernel = partitioned_param(
      self, 'kernel', self.kernel_init, self.kernel_axes, shape, self.param_dtype
    )
    inputs = jnp.asarray(inputs, self.dtype)
    kernel = jnp.asarray(kernel, self.dtype)
    # [..., *in] x [*in, *features] -> [..., *features]
    return self.kernels.dense(inputs, kernel, tuple(range(num_in)), self.out_dtype)


class Embed(nn.Module):
  """Token embedding table [vocab, embed]; `attend` gives tied output logits.

  Attributes:
    num_embeddings: vocabulary size.
    features: embedding width.
    kernels: the backend's primitives (`attend` multiplies with `kernels.dense`).
    dtype: dtype of the looked-up activations.
    param_dtype: storage dtype of the table.
  """

  num_embeddings: int
  features: int
  kernels: Kernels = reference.KERNELS
  dtype: DType = jnp.float32
  param_dtype: DType = jnp.float32

  def setup(self):
    self.embedding = partitioned_param(
      self,
      'embedding',
      nn.initializers.normal(stddev=1.0),
      ('vocab', 'embed'),
      (self.num_embeddings, self.features),  # [vocab, embed]
      self.param_dtype,
    )

  def __call__(self, inputs: Array) -> Array:
    """Looks up ids [...] -> embeddings [..., embed].

    Ids are cast to int32, so cache-initialising dummies like jnp.ones([b, l]) work.
    """
    ids = jnp.asarray(inputs).astype(jnp.int32)
    return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)

  def attend(self, query: Array) -> Array:
    """Tied logits: query [..., embed] @ embedding^T -> [..., vocab] in float32."""
    query = jnp.asarray(query, self.dtype)
    embedding = jnp.asarray(self.embedding, self.dtype)
    # [..., embed] x [vocab, embed] -> [..., vocab]
    return self.kernels.dense(query, embedding, (1,), jnp.float32)


class RMSNorm(nn.Module):
  """T5 layer norm: x / sqrt(mean(x^2) + eps) * scale, computed in float32.

  No mean subtraction and no bias; `scale` is initialised to ones.

  Attributes:
    epsilon: added to the mean square.
    kernels: the backend's primitives (`kernels.rms_norm` normalises).
    dtype: output dtype.
    param_dtype: storage dtype of `scale`.
    recompute: the backward pass keeps x in its own dtype and recomputes the float32
      intermediates, instead of keeping [..., embed] float32 copies (under
      `scan_layers` autodiff would stack them for every layer). Off inside a layer
      that is rematerialised as a whole, where a nested checkpoint only costs memory.
  """

  epsilon: float = 1e-6
  kernels: Kernels = reference.KERNELS
  dtype: DType = jnp.float32
  param_dtype: DType = jnp.float32
  recompute: bool = True

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """Normalises the last axis of x [..., embed]."""
    scale = partitioned_param(
      self, 'scale', nn.initializers.ones, ('embed',), (x.shape[-1],), self.param_dtype
    )
    rms_norm = self.kernels.rms_norm
    if self.recompute:
      rms_norm = jax.checkpoint(rms_norm, static_argnums=(2, 3))
    return rms_norm(x, scale, self.epsilon, self.dtype)


_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
  'relu': nn.relu,
  'gelu': lambda x: nn.gelu(x, approximate=True),
  'linear': lambda x: x,
}


def _gated_activations(activations: tuple[str, ...], *projected: Array) -> Array:
  """prod_i act_i(projected_i), each [batch, length, mlp]."""
  hidden = _ACTIVATIONS[activations[0]](projected[0])
  for name, h in zip(activations[1:], projected[1:]):
    hidden = hidden * _ACTIVATIONS[name](h)
  return hidden


_gated_activations_recomputed = jax.checkpoint(_gated_activations, static_argnums=(0,))


class MlpBlock(nn.Module):
  """T5 feed-forward block: wo(dropout(prod_i act_i(wi_i(x)))).

  One activation ('relu',) names the input kernel `wi`; several (gated GELU:
  ('gelu', 'linear')) name them `wi_0`, `wi_1`, ... and multiply the results.

  Attributes:
    mlp_dim: hidden width.
    activations: activation name per input projection ('relu', 'gelu', 'linear').
    dropout_rate: dropout on the hidden activations (broadcast over length, as T5X).
    kernels: the backend's primitives.
    dtype: computation dtype.
    param_dtype: storage dtype of the kernels.
    recompute: the backward pass keeps only the projections and recomputes the
      activation's intermediates (GELU's tanh and powers), which under `scan_layers`
      autodiff would otherwise stack for every layer. Off inside a layer that is
      rematerialised as a whole, where a nested checkpoint only costs memory.
  """

  mlp_dim: int
  activations: Sequence[str] = ('relu',)
  dropout_rate: float = 0.0
  kernels: Kernels = reference.KERNELS
  dtype: DType = jnp.float32
  param_dtype: DType = jnp.float32
  recompute: bool = True

  def _projection(self, features: int, kernel_axes: tuple[str, str], name: str) -> Projection:
    return Projection(
      features=(features,),
      kernel_axes=kernel_axes,
      kernels=self.kernels,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name=name,
    )

  @nn.compact
  def __call__(self, inputs: Array, deterministic: bool = True) -> Array:
    """Maps inputs [batch, length, embed] -> [batch, length, embed]."""
    emb_dim = inputs.shape[-1]
    projected = []
    for idx in range(len(self.activations)):
      name = 'wi' if len(self.activations) == 1 else f'wi_{idx}'
      # [batch, length, embed] -> [batch, length, mlp]
      projected.append(self._projection(self.mlp_dim, ('embed', 'mlp'), name)(inputs))
    activate = _gated_activations_recomputed if self.recompute else _gated_activations
    hidden = activate(tuple(self.activations), *projected)  # [batch, length, mlp]
    hidden = nn.Dropout(rate=self.dropout_rate, broadcast_dims=(-2,))(
      hidden, deterministic=deterministic
    )
    hidden = nn.with_logical_constraint(hidden, ('batch', 'length', 'mlp'))
    # [batch, length, mlp] -> [batch, length, embed]
    return self._projection(emb_dim, ('mlp', 'embed'), 'wo')(hidden)


class Adapter(nn.Module):
  """Adapter layer of the T5 paper (section 3.5.1): x + wo(relu(wi(x))).

  A dense-ReLU-dense block with a residual, inserted after a feed-forward sublayer
  so that fine-tuning can train it (and the layer norms) alone. `wo` starts at
  zero, so a freshly initialised adapter is exactly the identity and a network
  restored from a checkpoint without adapters computes what it did before.

  Attributes:
    adapter_dim: inner width d (the paper tries 32, 128, 512, 2048).
    kernels: the backend's primitives.
    dtype: computation dtype.
    param_dtype: storage dtype of the kernels.
  """

  adapter_dim: int
  kernels: Kernels = reference.KERNELS
  dtype: DType = jnp.float32
  param_dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """Maps inputs [batch, length, embed] -> [batch, length, embed]."""
    emb_dim = inputs.shape[-1]
    # [batch, length, embed] -> [batch, length, mlp]
    hidden = Projection(
      features=(self.adapter_dim,),
      kernel_axes=('embed', 'mlp'),
      kernels=self.kernels,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name='wi',
    )(inputs)
    hidden = nn.with_logical_constraint(nn.relu(hidden), ('batch', 'length', 'mlp'))
    # [batch, length, mlp] -> [batch, length, embed]
    output = Projection(
      features=(emb_dim,),
      kernel_axes=('mlp', 'embed'),
      kernel_init=nn.initializers.zeros,
      kernels=self.kernels,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name='wo',
    )(hidden)
    return inputs + output.astype(inputs.dtype)


def relative_position_bucket(
  relative_position: Array, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> Array:
  """T5's bucketing of relative positions (key_position - query_position).

  With n = query - key: bidirectional uses half the buckets per direction and
  offsets keys after the query (n < 0) by num_buckets/2, then uses |n|; causal uses
  max(n, 0). Of the buckets left, the first half are exact distances and the rest
  are log-spaced up to max_distance, clipped to the last bucket.

  Args:
    relative_position: int array of key_position - query_position.
    bidirectional: encoder (True) or causal decoder (False) bucketing.
    num_buckets: total number of buckets.
    max_distance: distances at or beyond it share the last bucket.

  Returns:
    int32 bucket ids with the shape of relative_position.
  """
  n = -jnp.asarray(relative_position, jnp.int32)
  bucket = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  log_ratio = jnp.log(n.astype(jnp.float32) / max_exact + np.finfo(np.float32).eps)
  log_ratio = log_ratio / np.log(max_distance / max_exact)
  val_if_large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(jnp.int32)
  val_if_large = jnp.minimum(val_if_large, num_buckets - 1)
  return bucket + jnp.where(is_small, n, val_if_large)


class RelativePositionBiases(nn.Module):
  """One learned [heads, buckets] table per stack, turned into attention biases.

  Attributes:
    num_buckets: number of relative position buckets.
    max_distance: distance at which the last bucket starts.
    num_heads: number of attention heads.
    dtype: dtype of the returned bias.
    param_dtype: storage dtype of the table.
  """

  num_buckets: int
  max_distance: int
  num_heads: int
  dtype: DType = jnp.float32
  param_dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, relative_position: Array, bidirectional: bool) -> Array:
    """Bias for relative positions [batch|1, q, k] (key - query) -> [batch|1, heads, q, k]."""
    table = partitioned_param(
      self,
      'rel_embedding',
      nn.initializers.variance_scaling(1.0, 'fan_avg', 'uniform'),
      ('heads', 'relpos_buckets'),
      (self.num_heads, self.num_buckets),
      self.param_dtype,
    )
    bucket = relative_position_bucket(
      relative_position, bidirectional, self.num_buckets, self.max_distance
    )  # [batch|1, q, k]
    # A one-hot matmul, heads-major, rather than a gather: its gradient is a matmul
    # too, where a gather's is a scatter over [q*k, heads] rows, which TPUs lay out
    # with `heads` padded to 128 lanes (a [32, 512, 512, 6] float32 gradient took
    # 4 GiB per chip). HIGHEST keeps the table's float32 values exact on TPUs.
    one_hot = jax.nn.one_hot(bucket, self.num_buckets, dtype=self.dtype)  # [batch|1, q, k, buckets]
    return jnp.einsum(
      'hn,bqkn->bhqk',
      jnp.asarray(table, self.dtype),
      one_hot,
      precision=jax.lax.Precision.HIGHEST,
    )  # [batch|1, heads, q, k]


def relative_positions(length_q: int, length_k: int) -> Array:
  """key_index - query_index as [1, q, k] int32.

  Packed examples need no positions here: inside a segment, positions run on
  with the index, so their differences equal the index differences, and pairs
  across segments are masked. One bias without a batch axis serves the whole
  batch, as in T5X.
  """
  positions_q = jnp.arange(length_q, dtype=jnp.int32)[None]  # [1, q]
  positions_k = jnp.arange(length_k, dtype=jnp.int32)[None]  # [1, k]
  return positions_k[:, None, :] - positions_q[:, :, None]  # [1, q, k]


def make_attention_mask(
  query_input: Array, key_input: Array, pairwise_fn: Callable[[Array, Array], Array] = jnp.multiply
) -> Array:
  """Pairwise mask [batch, 1, q, k] from per-position inputs [batch, q] and [batch, k]."""
  mask = pairwise_fn(query_input[:, :, None], key_input[:, None, :])  # [batch, q, k]
  return mask[:, None].astype(jnp.bool_)  # [batch, 1, q, k]


def make_causal_mask(length: int) -> Array:
  """Causal mask [1, 1, q, k]: query i sees keys j <= i."""
  idx = jnp.arange(length)
  return (idx[None, :] <= idx[:, None])[None, None]  # [1, 1, q, k]


def combine_masks(mask: Array, *masks: Array | None) -> Array:
  """Logical AND of the given (broadcastable) boolean masks; None entries are skipped."""
  for other in masks:
    if other is not None:
      mask = jnp.logical_and(mask, other)
  return mask


def prompt_end(prompt: Array) -> Array:
  """[batch] int32 position of the last nonzero token of each decoder prompt row
  [batch, length] (0 for a row of padding only: column 0 is the BOS)."""
  return jnp.max(jnp.arange(prompt.shape[1]) * (prompt > 0), axis=1).astype(jnp.int32)


def mask_to_bias(mask: Array) -> Array:
  """Boolean mask -> float32 additive bias (0 where visible, MASK_BIAS where masked)."""
  return jnp.where(mask, 0.0, MASK_BIAS).astype(jnp.float32)
