"""T5 building blocks in Flax linen: projections, embedding, RMSNorm, MLP, adapter,
attention, relative position biases and attention masks.

Every parameter is created through `nn.with_logical_partitioning` with the logical
axis names of the shared contract ('embed', 'heads', 'kv', 'mlp', 'vocab',
'relpos_buckets'); `t5x_lite.training.partitioning` maps those names to mesh axes.
No layer has a bias term. Attention logits carry no 1/sqrt(head_dim) factor: it is
folded into the query kernel's initialiser, as in T5 and T5X.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Dtype = Any
Initializer = Callable[..., Array]

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


class Projection(nn.Module):
  """A bias-free linear map written as a single einsum with a named kernel.

  Attributes:
    kernel_shape: shape of the kernel parameter.
    equation: einsum equation `inputs, kernel -> outputs`, e.g. '...e,ehd->...hd'.
    kernel_axes: logical axis names of the kernel.
    kernel_init: initialiser of the kernel (unboxed).
    dtype: computation dtype.
    param_dtype: storage dtype of the kernel.
    out_dtype: if set, the einsum accumulates into and returns this dtype.
  """

  kernel_shape: tuple[int, ...]
  equation: str
  kernel_axes: tuple[str, ...]
  kernel_init: Initializer = mlp_kernel_init()
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  out_dtype: Dtype | None = None

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """Applies the projection to `inputs`."""
    kernel = self.param(
      'kernel',
      nn.with_logical_partitioning(self.kernel_init, self.kernel_axes),
      self.kernel_shape,
      self.param_dtype,
    )
    inputs = jnp.asarray(inputs, self.dtype)
    kernel = jnp.asarray(kernel, self.dtype)
    return _einsum_over_tokens(self.equation, inputs, kernel, self.out_dtype)


def _einsum_over_tokens(
  equation: str, inputs: Array, kernel: Array, out_dtype: Dtype | None = None
) -> Array:
  """`jnp.einsum(equation, inputs, kernel)`; on CPU with the leading '...' dims merged.

  The equation starts with '...' on inputs and outputs. On XLA:CPU, merging
  [batch, length] into one token dimension (free in row-major order) makes the
  kernel gradient a plain [tokens, in]^T @ [tokens, out] matmul. With two contracted
  dims, XLA:CPU wrote the gated MLP's activation gradient transposed for that matmul,
  a strided copy of every [batch, length, mlp] array (2.2 s of thread time in a 10 s
  T5 1.1 small step). Merged, the results are the same to the bit. On TPU the merge is a
  relayout wherever the length is not a multiple of the tile (the decoder's 114), and
  it moved per-chip memory both ways (-0.28 GiB for scanned base, +0.13 to +0.22 GiB
  for small), so other platforms keep the plain einsum.

  On CPU, a projection with an equation '...{in},{in}{out}->...{out}' (every
  projection's but the tied logits') is one [tokens, in] @ [in, out] matmul
  (`_matmul_f32_accumulated` in bfloat16). jnp.einsum contracts the attention output
  projection's '...hd,hde' in the order (d, h), for which XLA:CPU transposes both
  operands: a copy of the kernel in every step of a decoding loop.
  """
  operands, out_spec = equation.split('->')
  in_spec, kernel_spec = operands.split(',')
  contracted = in_spec.removeprefix('...')
  explicit = len(contracted)
  lead = inputs.shape[: inputs.ndim - explicit]
  # '...{in},{in}{out}->...{out}': a [tokens, in] @ [in, out] matmul.
  matmul = kernel_spec.startswith(contracted) and out_spec == '...' + kernel_spec.removeprefix(
    contracted
  )
  bfloat16_matmul = (
    matmul
    and inputs.dtype == kernel.dtype == jnp.bfloat16
    and out_dtype in (None, jnp.bfloat16, jnp.float32)
  )

  def plain(x: Array, k: Array) -> Array:
    return jnp.einsum(equation, x, k, preferred_element_type=out_dtype)

  def merged(x: Array, k: Array) -> Array:
    if matmul:
      size_in = int(np.prod(x.shape[len(lead) :]))
      tokens = x.reshape(-1, size_in)  # [tokens, in]
      k = k.reshape(size_in, -1)  # [in, out]
      if bfloat16_matmul:
        out = _matmul_f32_accumulated(tokens, k, out_dtype or x.dtype)
      else:
        out = jnp.dot(tokens, k, preferred_element_type=out_dtype)
      return out.reshape(lead + kernel.shape[explicit:])  # [*lead, *out explicit]
    tokens = x.reshape((-1,) + x.shape[len(lead) :])  # [tokens, *explicit]
    out = jnp.einsum(equation, tokens, k, preferred_element_type=out_dtype)
    return out.reshape(lead + out.shape[1:])  # [*lead, *out explicit]

  if len(lead) < 2 and not matmul:
    return plain(inputs, kernel)
  return jax.lax.platform_dependent(inputs, kernel, cpu=merged, default=plain)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_f32_accumulated(x: Array, k: Array, out_dtype: Dtype) -> Array:
  """bfloat16 [..., m, n] @ [..., n, p] -> out_dtype, in the form XLA:CPU runs fastest.

  XLA:CPU hands a matmul to YNNPACK only in the plain row-major form [m, n] @ [n, p];
  there, bfloat16 operands with a float32 result run at about twice the float32 rate
  on CPUs with AVX512-BF16 (about 400 against 200 GFLOP/s on two Zen 4 cores at the
  gated MLP's shapes). Autodiff's backward products are g @ k^T and x^T @ g, which
  XLA folds into transposed-operand dots; those it computes in float32, converting
  both bfloat16 operands first (its own dot has no bfloat16 x bfloat16 = float32
  kernel). So the backward pass here copies k^T and x^T into row-major arrays
  (`_row_major_transpose`) and multiplies in the plain form. Every product
  accumulates in float32 and is rounded once to its result's dtype; the cotangent is
  rounded to bfloat16 first, as autodiff rounds a bfloat16 result's cotangent (and
  as T5X's and torch autocast's bfloat16 logits are). A gated MLP's forward and
  backward pass at the encoder's shape ([4096, 512] -> 1024) went from 258 to 146 ms.
  """
  return jnp.matmul(x, k, preferred_element_type=jnp.float32).astype(out_dtype)


def _matmul_f32_accumulated_fwd(
  x: Array, k: Array, out_dtype: Dtype
) -> tuple[Array, tuple[Array, Array]]:
  return _matmul_f32_accumulated(x, k, out_dtype), (x, k)


def _matmul_f32_accumulated_bwd(
  out_dtype: Dtype, residuals: tuple[Array, Array], g: Array
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


class Embed(nn.Module):
  """Token embedding table [vocab, embed]; `attend` gives tied output logits.

  Attributes:
    num_embeddings: vocabulary size.
    features: embedding width.
    dtype: dtype of the looked-up activations.
    param_dtype: storage dtype of the table.
  """

  num_embeddings: int
  features: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  def setup(self):
    self.embedding = self.param(
      'embedding',
      nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0), ('vocab', 'embed')),
      (self.num_embeddings, self.features),
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
    return _einsum_over_tokens('...e,ve->...v', query, embedding, jnp.float32)


class RMSNorm(nn.Module):
  """T5 layer norm: x / sqrt(mean(x^2) + eps) * scale, computed in float32.

  No mean subtraction and no bias; `scale` is initialised to ones.

  Attributes:
    epsilon: added to the mean square.
    dtype: output dtype.
    param_dtype: storage dtype of `scale`.
    recompute: the backward pass keeps x in its own dtype and recomputes the float32
      intermediates, instead of keeping [..., embed] float32 copies (under
      `scan_layers` autodiff would stack them for every layer). Off inside a layer
      that is rematerialised as a whole, where a nested checkpoint only costs memory.
  """

  epsilon: float = 1e-6
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  recompute: bool = True

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """Normalises the last axis of x [..., embed]."""
    scale = self.param(
      'scale',
      nn.with_logical_partitioning(nn.initializers.ones, ('embed',)),
      (x.shape[-1],),
      self.param_dtype,
    )
    rms_norm = _rms_norm_recomputed if self.recompute else _rms_norm
    return rms_norm(x, scale, self.epsilon, self.dtype)


def _rms_norm(x: Array, scale: Array, epsilon: float, dtype: Dtype) -> Array:
  """x [..., embed] -> normalised, in float32 inside."""
  x32 = jnp.asarray(x, jnp.float32)
  mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)  # [..., 1]
  y = x32 * jax.lax.rsqrt(mean_square + epsilon)
  scale = jnp.asarray(scale, jnp.float32)
  return jax.lax.platform_dependent(y, scale, cpu=_scaled_cpu, default=jnp.multiply).astype(dtype)


@jax.custom_vjp
def _scaled_cpu(y: Array, scale: Array) -> Array:
  """y [..., embed] * scale [embed]; the backward sums scale's gradient as a matmul.

  Autodiff sums g * y over every leading axis, a reduction to [embed] that XLA:CPU
  runs as a slow strided loop without its tree_reduction_rewriter, which
  `cli.CPU_XLA_FLAGS` turns off (that pass slows the softmax and every row reduction
  down; docs/performance.md, "Without XLA:CPU's tree reduction rewriter"). A [1, tokens] @ [tokens,
  embed] matmul with ones sums the same products: 0.85-1.0 ms at [8, 512, 512] on a
  2-core Zen 4, against 3.6 ms with the rewriter and 5.8 ms without. Only the order
  of the sum differs from autodiff's.
  """
  return y * scale


def _scaled_cpu_fwd(y: Array, scale: Array) -> tuple[Array, tuple[Array, Array]]:
  return y * scale, (y, scale)


def _scaled_cpu_bwd(residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
  y, scale = residuals
  rows = g.size // g.shape[-1]
  products = (g * y).reshape(rows, g.shape[-1])  # [tokens, embed]
  d_scale = jnp.ones((1, rows), products.dtype) @ products  # [1, embed]
  return g * scale, d_scale.reshape(scale.shape)


_scaled_cpu.defvjp(_scaled_cpu_fwd, _scaled_cpu_bwd)


_rms_norm_recomputed = jax.checkpoint(_rms_norm, static_argnums=(2, 3))


_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
  'relu': nn.relu,
  'gelu': lambda x: nn.gelu(x, approximate=True),
  'linear': lambda x: x,
}


def _gated_activations(activations: tuple[str, ...], *projected: Array) -> Array:
  """prod_i act_i(projected_i), each [batch, length, mlp]."""
  hidden = None
  for name, h in zip(activations, projected):
    h = _ACTIVATIONS[name](h)
    hidden = h if hidden is None else hidden * h
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
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  recompute: bool = True

  @nn.compact
  def __call__(self, inputs: Array, deterministic: bool = True) -> Array:
    """Maps inputs [batch, length, embed] -> [batch, length, embed]."""
    emb_dim = inputs.shape[-1]
    projected = []
    for idx in range(len(self.activations)):
      proj_name = 'wi' if len(self.activations) == 1 else f'wi_{idx}'
      # [batch, length, embed] -> [batch, length, mlp]
      h = Projection(
        (emb_dim, self.mlp_dim),
        '...e,em->...m',
        ('embed', 'mlp'),
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        name=proj_name,
      )(inputs)
      projected.append(h)
    activate = _gated_activations_recomputed if self.recompute else _gated_activations
    hidden = activate(tuple(self.activations), *projected)  # [batch, length, mlp]
    hidden = nn.Dropout(rate=self.dropout_rate, broadcast_dims=(-2,))(
      hidden, deterministic=deterministic
    )
    hidden = nn.with_logical_constraint(hidden, ('batch', 'length', 'mlp'))
    # [batch, length, mlp] -> [batch, length, embed]
    return Projection(
      (self.mlp_dim, emb_dim),
      '...m,me->...e',
      ('mlp', 'embed'),
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name='wo',
    )(hidden)


class Adapter(nn.Module):
  """Adapter layer of the T5 paper (section 3.5.1): x + wo(relu(wi(x))).

  A dense-ReLU-dense block with a residual, inserted after a feed-forward sublayer
  so that fine-tuning can train it (and the layer norms) alone. `wo` starts at
  zero, so a freshly initialised adapter is exactly the identity and a network
  restored from a checkpoint without adapters computes what it did before.

  Attributes:
    adapter_dim: inner width d (the paper tries 32, 128, 512, 2048).
    dtype: computation dtype.
    param_dtype: storage dtype of the kernels.
  """

  adapter_dim: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """Maps inputs [batch, length, embed] -> [batch, length, embed]."""
    emb_dim = inputs.shape[-1]
    # [batch, length, embed] -> [batch, length, mlp]
    hidden = Projection(
      (emb_dim, self.adapter_dim),
      '...e,em->...m',
      ('embed', 'mlp'),
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name='wi',
    )(inputs)
    hidden = nn.with_logical_constraint(nn.relu(hidden), ('batch', 'length', 'mlp'))
    # [batch, length, mlp] -> [batch, length, embed]
    output = Projection(
      (self.adapter_dim, emb_dim),
      '...m,me->...e',
      ('mlp', 'embed'),
      nn.initializers.zeros,
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
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, relative_position: Array, bidirectional: bool) -> Array:
    """Bias for relative positions [batch|1, q, k] (key - query) -> [batch|1, heads, q, k]."""
    table = self.param(
      'rel_embedding',
      nn.with_logical_partitioning(
        nn.initializers.variance_scaling(1.0, 'fan_avg', 'uniform'), ('heads', 'relpos_buckets')
      ),
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


def combine_masks(*masks: Array | None) -> Array | None:
  """Logical AND of the given (broadcastable) boolean masks; None entries are skipped."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  mask = masks[0]
  for other in masks[1:]:
    mask = jnp.logical_and(mask, other)
  return mask


def prompt_end(prompt: Array) -> Array:
  """[batch] int32 position of the last nonzero token of each decoder prompt row
  [batch, length] (0 for a row of padding only: column 0 is the BOS)."""
  return jnp.max(jnp.arange(prompt.shape[1]) * (prompt > 0), axis=1).astype(jnp.int32)


def mask_to_bias(mask: Array) -> Array:
  """Boolean mask -> float32 additive bias (0 where visible, MASK_BIAS where masked)."""
  return jnp.where(mask, 0.0, MASK_BIAS).astype(jnp.float32)


def causal_step_bias(distance_bias: Array, position: Array, length: int) -> Array:
  """Self-attention bias for one decode step at `position` against `length` cached keys.

  Args:
    distance_bias: [1, heads, 1, D] bias by causal distance d = query - key, where
      distances >= D - 1 share the last entry (T5's buckets saturate at max_distance).
    position: 0-d int32 index of the current query.
    length: number of cache slots.

  Returns:
    [1, heads, 1, length] float32: relative bias for keys <= position, MASK_BIAS after.
  """
  key_positions = jnp.arange(length, dtype=jnp.int32)  # [length]
  distance = jnp.clip(position - key_positions, 0, distance_bias.shape[-1] - 1)  # [length]
  bias = jnp.take(distance_bias.astype(jnp.float32), distance, axis=-1)  # [1, heads, 1, length]
  return jnp.where(key_positions <= position, bias, MASK_BIAS)


def dot_product_attention(
  query: Array,
  key: Array,
  value: Array,
  biases: Sequence[Array],
  dropout_rate: float,
  deterministic: bool,
  dropout_rng: Array | None,
  dtype: Dtype,
  heads_major_kv: bool = False,
  logits_dtype: Dtype = jnp.float32,
  kv_major_key: bool = False,
) -> Array:
  """Unscaled dot-product attention; logits, biases and softmax in `logits_dtype`.

  Args:
    query: [batch, q, heads, kv].
    key: [batch, k, heads, kv], or [batch, heads, k, kv] if heads_major_kv.
    value: like key.
    biases: additive float32 biases broadcastable to [batch, heads, q, k].
    dropout_rate: dropout on the attention weights (mask broadcast over queries, as T5X).
    deterministic: disables dropout.
    dropout_rng: PRNG key for dropout.
    dtype: dtype of the weights used in the value matmul.
    heads_major_kv: key/value come as [batch, heads, k, kv] (the decode caches'
      layout, in which both matmuls need no transpose of the long key axis).
    kv_major_key: with heads_major_kv, key comes as [batch, heads, kv, k] (the
      cross-attention cache): both matmuls are then plain [q, kv] @ [kv, k] and
      [q, k] @ [k, kv] per batch and head, which XLA:CPU runs at full speed for the
      several queries of a decode step whose beams share the keys.
    logits_dtype: dtype of the logits and the softmax: float32 (T5X's
      `float32_logits=True`), or bfloat16 (flaxformer's default with bfloat16
      activations), which halves the [batch, heads, q, k] buffers.

  Returns:
    [batch, q, heads, kv].
  """
  # On CPU, bfloat16 attention over [batch, k, heads, kv] keys runs both matmuls as
  # `_matmul_f32_accumulated` (see there), on row-major heads-major copies; other
  # dtypes run the value product's forward on a heads-major copy of the values
  # (`_values_heads_major_forward`).
  bfloat16_cpu = not heads_major_kv and query.dtype == key.dtype == value.dtype == jnp.bfloat16

  def plain_logits(q: Array, k: Array) -> Array:
    if heads_major_kv:
      key_axes = 'bhdk' if kv_major_key else 'bhkd'
      q = jnp.swapaxes(q, 1, 2)  # [batch, heads, q, kv]
      return jnp.einsum(f'bhqd,{key_axes}->bhqk', q, k, preferred_element_type=logits_dtype)
    return jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=logits_dtype)

  def cpu_logits(q: Array, k: Array) -> Array:
    q = _row_major(jnp.swapaxes(q, 1, 2))  # [batch, heads, q, kv]
    k = _row_major(jnp.transpose(k, (0, 2, 3, 1)))  # [batch, heads, kv, k]
    return _matmul_f32_accumulated(q, k, logits_dtype)

  def plain_values(w: Array, v: Array) -> Array:
    if heads_major_kv:  # [batch, heads, q, kv], then the (small) output transposed
      return jnp.swapaxes(jnp.einsum('bhqk,bhkd->bhqd', w, v), 1, 2)
    return _plain_values(w, v)

  def cpu_values(w: Array, v: Array) -> Array:
    v = _row_major(jnp.swapaxes(v, 1, 2))  # [batch, heads, k, kv]
    out = _matmul_f32_accumulated(w, v, w.dtype)  # [batch, heads, q, kv]
    return jnp.swapaxes(out, 1, 2)  # [batch, q, heads, kv]

  # [batch, q, heads, kv] x key -> [batch, heads, q, k]
  if bfloat16_cpu:
    logits = jax.lax.platform_dependent(query, key, cpu=cpu_logits, default=plain_logits)
  else:
    logits = plain_logits(query, key)
  for bias in biases:
    logits = logits + bias.astype(logits_dtype)
  weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
  if not deterministic and dropout_rate > 0.0:
    keep_prob = 1.0 - dropout_rate
    keep_shape = weights.shape[:-2] + (1,) + weights.shape[-1:]  # [batch, heads, 1, k]
    keep = jax.random.bernoulli(dropout_rng, keep_prob, keep_shape)
    weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype))
  # [batch, heads, q, k] x value -> [batch, q, heads, kv]
  if bfloat16_cpu and weights.dtype == jnp.bfloat16:
    return jax.lax.platform_dependent(weights, value, cpu=cpu_values, default=plain_values)
  if not heads_major_kv:
    return jax.lax.platform_dependent(
      weights, value, cpu=_values_heads_major_forward, default=plain_values
    )
  return plain_values(weights, value)


@jax.custom_vjp
def _values_heads_major_forward(weights: Array, value: Array) -> Array:
  """`einsum('bhqk,bkhd->bqhd', weights, value)`, the forward with [batch, heads, k, kv] values.

  XLA:CPU multiplies the [batch, k, heads, kv] values in place more slowly than a
  [batch, heads, k, kv] copy of them (an [8, 6, 512, 512] encoder attention on a Zen 4:
  16.3 against 12.3 ms, the copy included; the whole attention's forward: 39-47 against
  35-37 ms), with the same result to the bit. That copy's backward is slower than the
  plain einsum's (fwd + bwd: 127 against 114 ms), so the backward is the plain einsum's
  vjp; its value gradient may differ from autodiff's in the last bit (XLA fuses it
  differently).
  """
  return jnp.swapaxes(jnp.einsum('bhqk,bhkd->bhqd', weights, jnp.swapaxes(value, 1, 2)), 1, 2)


def _plain_values(weights: Array, value: Array) -> Array:
  return jnp.einsum('bhqk,bkhd->bqhd', weights, value)


def _values_heads_major_forward_fwd(weights: Array, value: Array) -> tuple[Array, tuple]:
  return _values_heads_major_forward(weights, value), (weights, value)


def _values_heads_major_forward_bwd(residuals: tuple[Array, Array], g: Array):
  _, vjp = jax.vjp(_plain_values, *residuals)
  return vjp(g)


_values_heads_major_forward.defvjp(_values_heads_major_forward_fwd, _values_heads_major_forward_bwd)


def _fold_decodes(query: Array, kv_batch: int, cross_attention: bool) -> Array:
  """[batch * d, q, heads, kv] -> [batch, d * q, heads, kv] for keys with `kv_batch` rows.

  The d decodes of a batch row (consecutive rows, see `decoding.expand_to_beams`) attend
  to the same encoder keys, so they are that row's d * q queries.
  """
  rows, length_q = query.shape[:2]
  if not cross_attention or rows % kv_batch:
    raise ValueError(
      f'attention queries have {rows} rows and keys {kv_batch}: only cross-attention may '
      'share one key row among several (a whole multiple of) query rows'
    )
  return query.reshape(kv_batch, rows // kv_batch * length_q, *query.shape[2:])


class MultiHeadAttention(nn.Module):
  """T5 multi-head attention with 3-D kernels and optional single-step decoding cache.

  Kernels: query/key/value [embed, heads, kv], out [heads, kv, embed]. With
  `decode=True` the module keeps, in the 'cache' collection, `cached_key` and
  `cached_value` of shape [batch, heads, cache_length, kv] (batch leading, so
  beam search can expand or gather them; heads before length, so that a decode
  step's two attention matmuls read the cache in place, where a [batch, length,
  heads, kv] cache is transposed in full at every step; the cross-attention key
  cache is [batch, heads, kv, k], see `dot_product_attention`); the step index lives
  with the caller (the Decoder's 0-d `cache_index`). Self-attention writes one key/value per step,
  so a step costs O(cache_length). Cross-attention (`cross_attention=True`)
  projects the encoder output once, in the cache-creating call, and only reads
  it in the steps (no per-step branch or copy: inside a decoding loop the cached
  projection is loop-invariant). Its inputs_kv may have batch rows where inputs_q has
  batch * d (the d samples or beams of each row, consecutive): the encoder output is
  then projected, cached and read once per batch row, not once per decode.

  Attributes:
    num_heads: number of heads.
    head_dim: size of each head.
    dropout_rate: dropout on attention weights.
    cross_attention: whether keys/values come from a fixed encoder output.
    dtype: computation dtype.
    param_dtype: storage dtype of the kernels.
    logits_dtype: dtype of the attention logits and softmax (see
      `dot_product_attention`).
  """

  num_heads: int
  head_dim: int
  dropout_rate: float = 0.0
  cross_attention: bool = False
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  logits_dtype: Dtype = jnp.float32

  def _in_projection(self, name: str, emb_dim: int, scale: float) -> Projection:
    return Projection(
      (emb_dim, self.num_heads, self.head_dim),
      '...e,ehd->...hd',
      ('embed', 'heads', 'kv'),
      attention_kernel_init(scale, 'in'),
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name=name,
    )

  def _project_kv(self, inputs_kv: Array) -> tuple[Array, Array]:
    """inputs_kv [batch, k, embed] -> key, value [batch, k, heads, kv]."""
    emb_dim = inputs_kv.shape[-1]
    key = self._in_projection('key', emb_dim, 1.0)(inputs_kv)  # [batch, k, heads, kv]
    value = self._in_projection('value', emb_dim, 1.0)(inputs_kv)  # [batch, k, heads, kv]
    axes = ('batch', 'length', 'heads', 'kv')
    return nn.with_logical_constraint(key, axes), nn.with_logical_constraint(value, axes)

  def _init_cache(self, key: Array, value: Array, cache_length: int | None) -> None:
    """Creates the key/value caches [batch, heads, length, kv].

    Self-attention caches start as zeros of `cache_length` (default: the input
    length); cross-attention caches hold `key`/`value` [batch, k, heads, kv], the
    projected encoder output, the key as [batch, heads, kv, k].
    """
    if self.cross_attention:
      # key [batch, k, heads, kv] -> [batch, heads, kv, k] (see dot_product_attention's
      # kv_major_key), value -> [batch, heads, k, kv]
      self.variable(
        'cache', 'cached_key', lambda: jnp.transpose(key, (0, 2, 3, 1)).astype(self.dtype)
      )
      self.variable('cache', 'cached_value', lambda: jnp.swapaxes(value, 1, 2).astype(self.dtype))
      return
    batch, length = key.shape[:2]
    length = length if cache_length is None else cache_length
    cache_shape = (batch, self.num_heads, length, self.head_dim)  # [batch, heads, length, kv]
    self.variable('cache', 'cached_key', jnp.zeros, cache_shape, self.dtype)
    self.variable('cache', 'cached_value', jnp.zeros, cache_shape, self.dtype)

  def _prefill_cache(self, key: Array, value: Array) -> None:
    """Writes a whole prompt's key/value [batch, k, heads, kv] to cache slots [0, k)."""
    for name, new in (('cached_key', key), ('cached_value', value)):
      cache = self.variable('cache', name)
      new = jnp.swapaxes(new, 1, 2).astype(self.dtype)  # [batch, heads, k, kv]
      cache.value = jax.lax.dynamic_update_slice(cache.value, new, (0, 0, 0, 0))

  def _decode_step_kv(
    self, inputs_kv: Array, decode_position: Array, prefilled: Array | None
  ) -> tuple[Array, Array]:
    """Updates the cache for one step; returns all keys/values [batch, heads, length, kv]
    (a cross-attention key: [batch, heads, kv, length]).

    Self-attention writes this step's key/value at decode_position, except in the
    rows where `prefilled` [batch] says that slot holds a prefilled prompt's; cross-attention
    reads the projection cached when the cache was created (inputs_kv is unused).
    """
    cached_key = self.variable('cache', 'cached_key')
    cached_value = self.variable('cache', 'cached_value')
    if self.cross_attention:
      return cached_key.value, cached_value.value
    new_key, new_value = self._project_kv(inputs_kv)  # [batch, 1, heads, kv]
    new_key = jnp.swapaxes(new_key, 1, 2).astype(self.dtype)  # [batch, heads, 1, kv]
    new_value = jnp.swapaxes(new_value, 1, 2).astype(self.dtype)  # [batch, heads, 1, kv]
    start = (0, 0, decode_position, 0)
    if prefilled is not None:
      keep = prefilled[:, None, None, None]  # [batch, 1, 1, 1]
      old_key = jax.lax.dynamic_slice(cached_key.value, start, new_key.shape)
      old_value = jax.lax.dynamic_slice(cached_value.value, start, new_value.shape)
      new_key = jnp.where(keep, old_key, new_key)  # [batch, heads, 1, kv]
      new_value = jnp.where(keep, old_value, new_value)  # [batch, heads, 1, kv]
    key = jax.lax.dynamic_update_slice(cached_key.value, new_key, start)
    value = jax.lax.dynamic_update_slice(cached_value.value, new_value, start)
    cached_key.value, cached_value.value = key, value
    return key, value

  @nn.compact
  def __call__(
    self,
    inputs_q: Array,
    inputs_kv: Array,
    mask_bias: Array | None = None,
    position_bias: Array | None = None,
    *,
    deterministic: bool = True,
    decode: bool = False,
    decode_position: Array | None = None,
    cache_length: int | None = None,
    prefilled: Array | None = None,
  ) -> Array:
    """Attends from inputs_q [batch, q, embed] to inputs_kv [batch, k, embed].

    Args:
      inputs_q: query-side inputs [batch, q, embed].
      inputs_kv: key/value-side inputs [batch, k, embed]; for cross-attention also
        [batch / d, k, embed], shared by each d consecutive query rows.
      mask_bias: additive float32 mask bias broadcastable to [batch, heads, q, k]
        ([batch / d, heads, 1, k] when inputs_kv is shared, see above).
      position_bias: additive relative-position bias [batch|1, heads, q, k]; in a
        self-attention decode step it is the bias by causal distance [1, heads, 1, D]
        (see `causal_step_bias`).
      deterministic: disables dropout.
      decode: creates (first call) and uses the key/value cache.
      decode_position: 0-d int32 step index; None means a full-sequence call, which
        with decode=True initialises the cache if there is none, and otherwise
        (self-attention) prefills it: writes this call's keys/values to its first slots.
      cache_length: cache length for self-attention; defaults to the input length.
      prefilled: [batch] bool, in a self-attention decode step: rows whose cache slot
        at decode_position holds a prefilled prompt's key/value, kept as it is.

    Returns:
      [batch, q, embed].
    """
    emb_dim = inputs_q.shape[-1]
    # [batch, q, embed] -> [batch, q, heads, kv]
    query = self._in_projection('query', emb_dim, 1.0 / self.head_dim)(inputs_q)
    query = nn.with_logical_constraint(query, ('batch', 'length', 'heads', 'kv'))
    biases = [mask_bias]
    step = decode and decode_position is not None
    if step:
      # [batch, heads, k, kv]
      key, value = self._decode_step_kv(inputs_kv, decode_position, prefilled)
      if not self.cross_attention:
        biases.append(causal_step_bias(position_bias, decode_position, key.shape[2]))
    else:
      key, value = self._project_kv(inputs_kv)
      biases.append(position_bias)
      if decode and self.has_variable('cache', 'cached_key') and not self.cross_attention:
        self._prefill_cache(key, value)
      elif decode:
        self._init_cache(key, value, cache_length)
    rows, length_q = query.shape[:2]
    if key.shape[0] != rows:
      # Decodes sharing their batch row's encoder output: fold them into the query axis.
      query = _fold_decodes(query, key.shape[0], self.cross_attention)  # [batch, d * q, ...]
    dropout_rng = None
    if not deterministic and self.dropout_rate > 0.0:
      dropout_rng = self.make_rng('dropout')
    out = dot_product_attention(
      query,
      key,
      value,
      [b for b in biases if b is not None],
      self.dropout_rate,
      deterministic,
      dropout_rng,
      self.dtype,
      heads_major_kv=step,
      logits_dtype=self.logits_dtype,
      kv_major_key=step and self.cross_attention,
    ).reshape(rows, length_q, self.num_heads, self.head_dim)  # [batch, q, heads, kv]
    # [batch, q, heads, kv] -> [batch, q, embed]
    return Projection(
      (self.num_heads, self.head_dim, emb_dim),
      '...hd,hde->...e',
      ('heads', 'kv', 'embed'),
      attention_kernel_init(1.0, 'out'),
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name='out',
    )(out)
